"""Cronus's balancer (§4.3-4.4 and Appendix A, Algorithm 1): how much of a prompt the low-end GPU prefills.

A Cronus pair is a partial prefill instance (PPI, the low-end GPU: one prompt at a time) and a chunked prefill
instance (CPI, the high-end GPU: the rest of every prompt as chunked prefill beside its decodes). The two stay
balanced when the PPI's time for the first L_p tokens of a prompt equals the CPI's time to finish the other
L_in - L_p, so the balancer tries 512 evenly spaced split points and keeps the one where the two predicted
times are closest:

- the PPI's prefill time is linear in the tokens it prefills: T_p = k_p L_p + b_p (Eq. 2);
- one CPI iteration is linear in the prefill's context and in the decodes' total context:
  t = k_ctxp L_ctxp + k_ctxd sum L_d + b_c (Eq. 3); each iteration carries B - n_d prefill tokens (B the
  iteration's token budget, n_d its decodes), so the rest takes N_iter = ceil((L_in - L_p) / (B - n_d))
  iterations, whose times grow linearly from the first to the last: T_c = N_iter (t_first + t_last) / 2 (Eq. 1).

When the CPI has no KV room for the whole prompt, the PPI prefills all of it (Algorithm 1's first branch). The
printed algorithm writes the mean iteration's prefill context as (L_in + L_last) / 2 with L_last = L_p +
floor(L_c / n_p) n_p; this module takes Eq. 1 as written in the text instead, with the first iteration's
context L_p + n_p and the last one's L_in, which is what the arithmetic sequence of Eq. 1 sums (the two agree
within one chunk).

Pure: the coefficients are fitted elsewhere (on profiles, `hetnode.planner.cronus_fit`), the CPI's state is
passed in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

CANDIDATES = 512  # split points tried per prompt (Algorithm 1: L_in x i / 512)
PPI_LIMIT = 2  # §4.2: "limiting the total number of requests in the PPI to at most two at a time"


@dataclass(frozen=True, slots=True)
class LinearPrefill:
    """T_p(L) = k * L + b: the PPI's seconds to prefill L tokens of a prompt alone."""

    k: float
    b: float

    def seconds(self, tokens: int) -> float:
        return self.k * tokens + self.b if tokens > 0 else 0.0


@dataclass(frozen=True, slots=True)
class ChunkedIteration:
    """t(L_ctxp, sum L_d) = k_ctxp * L_ctxp + k_ctxd * sum L_d + b: one CPI iteration's seconds."""

    k_ctxp: float
    k_ctxd: float
    b: float

    def seconds(self, prefill_context: float, decode_context: float) -> float:
        return self.k_ctxp * prefill_context + self.k_ctxd * decode_context + self.b


@dataclass(frozen=True, slots=True)
class CpiState:
    """What the CPI reports to the balancer (its statistics at the moment a prompt is dispatched)."""

    decodes: int  # n_d: decode requests in its batch
    decode_context: int  # sum of their context lengths
    free_blocks: int  # KV blocks free
    block_size: int  # tokens per block
    max_batch_tokens: int  # B: tokens one iteration carries

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_batch_tokens < 1:
            raise ValueError(f"block_size ({self.block_size}) and max_batch_tokens ({self.max_batch_tokens}) "
                             "must be >= 1")
        if self.decodes < 0 or self.decode_context < 0 or self.free_blocks < 0:
            raise ValueError("decodes, decode_context and free_blocks must be >= 0")


@dataclass(frozen=True, slots=True)
class Split:
    tokens: int  # L_p: the prompt tokens the PPI prefills (the whole prompt when the CPI has no room)
    ppi_s: float  # predicted PPI time
    cpi_s: float  # predicted CPI time to finish the rest


class CronusBalancer:
    def __init__(self, ppi: LinearPrefill, cpi: ChunkedIteration, *, candidates: int = CANDIDATES) -> None:
        if candidates < 1:
            raise ValueError(f"candidates must be >= 1, not {candidates}")
        self.ppi = ppi
        self.cpi = cpi
        self.candidates = candidates

    def split(self, prompt: int, state: CpiState) -> Split:
        """Algorithm 1: the partial prefill length of a prompt of `prompt` tokens."""
        if prompt < 1:
            raise ValueError(f"a prompt has at least one token, not {prompt}")
        if state.free_blocks < math.ceil(prompt / state.block_size):
            return Split(prompt, self.ppi.seconds(prompt), 0.0)
        per_iteration = state.max_batch_tokens - state.decodes
        if per_iteration < 1:  # the CPI's budget goes to its decodes: only the PPI can prefill now
            return Split(prompt, self.ppi.seconds(prompt), math.inf)
        # The 512 candidates with the predictors inlined (a routing decision's whole cost): the same arithmetic
        # as `LinearPrefill.seconds` and `_chunked`, without a call or an object per candidate.
        kp, bp = self.ppi.k, self.ppi.b
        kc, bc = self.cpi.k_ctxp, self.cpi.k_ctxd * state.decode_context + self.cpi.b
        last_s = kc * prompt + bc  # the last iteration's context is always the whole prompt
        best_lp, best_gap, best_p, best_c = 0, math.inf, 0.0, 0.0
        previous = 0
        for i in range(1, self.candidates + 1):
            lp = -(-prompt * i // self.candidates)
            if lp == previous:
                continue
            previous = lp
            rest = prompt - lp
            ppi_s = kp * lp + bp
            if rest > 0:
                first_s = kc * (lp + (rest if rest < per_iteration else per_iteration)) + bc
                cpi_s = -(-rest // per_iteration) * (first_s + last_s) / 2
            else:
                cpi_s = 0.0
            gap = abs(ppi_s - cpi_s)
            if gap < best_gap:
                best_lp, best_gap, best_p, best_c = lp, gap, ppi_s, cpi_s
        return Split(best_lp, best_p, best_c)


class Splitter(Protocol):
    """What picks a prompt's partial prefill length: `CronusBalancer`, or `WholePrompt`."""

    def split(self, prompt: int, state: CpiState) -> Split: ...


class WholePrompt:
    """Disaggregated prefill through Cronus's code path (§5.1: "the same code as our partial prefill
    implementation, but always set the partial prefill length to the input length")."""

    def split(self, prompt: int, state: CpiState) -> Split:
        if prompt < 1:
            raise ValueError(f"a prompt has at least one token, not {prompt}")
        return Split(prompt, 0.0, 0.0)
