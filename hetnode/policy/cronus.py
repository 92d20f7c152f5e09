"""Cronus's balancer (§4.3-4.4 and Appendix A, Algorithm 1): how much of a prompt the low-end GPU prefills.

A Cronus pair is a partial prefill instance (PPI, the low-end GPU: one prompt at a time) and a chunked prefill
instance (CPI, the high-end GPU: the rest of every prompt as chunked prefill beside its decodes). The two stay
balanced when the PPI's time for the first L_p tokens of a prompt equals the CPI's time to finish the other
L_in - L_p, so the balancer takes, of 512 evenly spaced split points, the one where the two predicted times
are closest (the same one as trying them all, found from about five of them: `CronusBalancer.split`):

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
        """Algorithm 1: the partial prefill length of a prompt of `prompt` tokens.

        The choice of trying every candidate (`_scan_split`: the smallest L_p of the least |T_p - T_c|, the
        same floats), from a handful of them. Candidates whose rest takes the same number of iterations N
        form a segment, over which D = T_p - T_c is a line in L_p: |D| falls to the line's root and rises after
        it. A segment evaluates its two end candidates, then walks out from where the line crosses zero, in each
        direction until a candidate is worse than the best so far by more than the predictors' rounding could
        explain and lies on the rising side of the root: every candidate further on is worse still.
        With non-negative coefficients (fitted ones are) D also rises from segment to segment (shifting a
        point by one iteration's tokens to the next segment adds k_p B' to T_p and takes at least
        k_ctxp B' + b_c off T_c), so only the segments around the crossing are visited: going outwards, a
        segment whose whole line is beyond the best gap (on the side away from zero) ends the search that way.
        """
        if prompt < 1:
            raise ValueError(f"a prompt has at least one token, not {prompt}")
        if state.free_blocks < math.ceil(prompt / state.block_size):
            return Split(prompt, self.ppi.seconds(prompt), 0.0)
        per = state.max_batch_tokens - state.decodes
        if per < 1:  # the CPI's budget goes to its decodes: only the PPI can prefill now
            return Split(prompt, self.ppi.seconds(prompt), math.inf)
        kp, bp = self.ppi.k, self.ppi.b
        kc, bc = self.cpi.k_ctxp, self.cpi.k_ctxd * state.decode_context + self.cpi.b
        last_s = kc * prompt + bc  # the last iteration's context is always the whole prompt
        # The distinct candidates in order: ceil(prompt i / count) for i = 1..count (below `candidates` tokens,
        # every L_p from 1 to the prompt, which is what the scan's ceil(prompt i / candidates) gives).
        count = min(self.candidates, prompt)
        top = -(-(prompt - 1) // per)  # the most iterations a rest takes (the segments are N = 0..top)
        # What one evaluation of D can be off by: a few roundings of terms no larger than these. Far above the
        # real rounding, so that a candidate is only skipped when it is worse beyond doubt.
        scale = abs(kp) * (prompt + per) + abs(bp) + top * (abs(kc) * (prompt + per) + abs(bc) + abs(last_s))
        slack = scale * 2.0**-40 + 1e-300
        best_lp, best_gap, best_p, best_c = 0, math.inf, 0.0, 0.0  # the scan's starting point

        def difference(i: int) -> float:
            """D at candidate i with the scan's arithmetic, keeping the best candidate as the scan would."""
            nonlocal best_lp, best_gap, best_p, best_c
            lp = -(-prompt * i // count)
            rest = prompt - lp
            ppi_s = kp * lp + bp
            if rest > 0:
                first_s = kc * (lp + (rest if rest < per else per)) + bc
                cpi_s = -(-rest // per) * (first_s + last_s) / 2
            else:
                cpi_s = 0.0
            gap = abs(ppi_s - cpi_s)
            if gap < best_gap or (gap == best_gap and lp < best_lp):  # the scan keeps the earliest of a tie
                best_lp, best_gap, best_p, best_c = lp, gap, ppi_s, cpi_s
            return ppi_s - cpi_s

        if top >= count // 4 or not math.isfinite(slack):
            # Segments of a few candidates each (a CPI whose budget its decodes nearly fill, a short prompt):
            # nothing to save; or predictors that overflow, where rounding has no bound: try them all.
            for i in range(1, count + 1):
                difference(i)
            return Split(best_lp, best_p, best_c)

        def segment(n: int) -> None:
            """Visit the candidates whose rest takes n iterations: L_p in [prompt - n per, prompt - (n-1) per - 1]."""
            high = prompt - (n - 1) * per - 1 if n else prompt
            a = (max(1, prompt - n * per) - 1) * count // prompt + 1  # the first i of ceil(prompt i / count) >= low
            b = min(high * count // prompt, count)  # and the last one <= high
            if a > b:
                return
            da = difference(a)
            if b == a:
                return
            db = difference(b)
            if b == a + 1:
                return
            rise = db - da
            if abs(rise) <= 4 * slack:  # flat to within rounding: which side of the root is unknowable
                for i in range(a + 1, b):
                    difference(i)
                return
            up = rise > 0  # D grows with i here
            # Where the line crosses zero, interpolated between the ends: only where the walks start (what they
            # skip follows from the signs they see).
            t = -da / rise
            start = a - 1 if t <= 0 else b if t >= 1 else a + int(t * (b - a))
            i = start
            while i >= a:  # towards smaller L_p, until left of the root beyond doubt and worse than the best
                d = da if i == a else db if i == b else difference(i)
                if abs(d) > best_gap + 2 * slack and (d < 0) == up:
                    break
                i -= 1
            i = start + 1
            while i <= b:  # towards larger L_p, until right of the root beyond doubt and worse than the best
                d = da if i == a else db if i == b else difference(i)
                if abs(d) > best_gap + 2 * slack and (d > 0) == up:
                    break
                i += 1

        if not (kp >= 0 and kc >= 0 and bc >= 0):  # no order between the segments to use: visit them all
            for n in range(top + 1):
                segment(n)
            return Split(best_lp, best_p, best_c)

        def ends(n: int) -> tuple[float, float]:
            """D on segment n's line at both ends of its L_p range (unclamped), within `slack`."""
            if n == 0:
                return kp * prompt + bp, kp * prompt + bp
            low, high = prompt - n * per, prompt - (n - 1) * per - 1
            if n == 1:
                return kp * low + bp - last_s, kp * high + bp - last_s
            return (kp * low + bp - n * (kc * (low + per) + bc + last_s) / 2,
                    kp * high + bp - n * (kc * (high + per) + bc + last_s) / 2)

        # The crossing: the last segment whose line still ends at or above zero (D at a segment's upper end
        # falls with n, so a bisection finds it; only a starting point, so rounding here does no harm).
        lo, hi = 0, top
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ends(mid)[1] >= 0:
                lo = mid
            else:
                hi = mid - 1
        segment(lo)
        for n in range(lo - 1, -1, -1):  # towards larger L_p: D only grows
            if min(ends(n)) > best_gap + 3 * slack:  # so does every segment after it
                break
            segment(n)
        for n in range(lo + 1, top + 1):  # towards smaller L_p: D only falls
            if max(ends(n)) < -(best_gap + 3 * slack):
                break
            segment(n)
        return Split(best_lp, best_p, best_c)


def _scan_split(balancer: CronusBalancer, prompt: int, state: CpiState) -> Split:
    """Algorithm 1 as printed: every candidate split point tried in turn. `CronusBalancer.split` must choose
    exactly as this does (the tests compare the two); it is kept as their reference, not called in serving."""
    if prompt < 1:
        raise ValueError(f"a prompt has at least one token, not {prompt}")
    if state.free_blocks < math.ceil(prompt / state.block_size):
        return Split(prompt, balancer.ppi.seconds(prompt), 0.0)
    per_iteration = state.max_batch_tokens - state.decodes
    if per_iteration < 1:
        return Split(prompt, balancer.ppi.seconds(prompt), math.inf)
    kp, bp = balancer.ppi.k, balancer.ppi.b
    kc, bc = balancer.cpi.k_ctxp, balancer.cpi.k_ctxd * state.decode_context + balancer.cpi.b
    last_s = kc * prompt + bc
    best_lp, best_gap, best_p, best_c = 0, math.inf, 0.0, 0.0
    previous = 0
    for i in range(1, balancer.candidates + 1):
        lp = -(-prompt * i // balancer.candidates)
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
