"""Turning last-position logits into tokens: greedy, temperature, top-k, top-p, per-request seeds.

A seeded request draws its random number from (seed, position) alone, never from a generator shared with
other requests, so its tokens do not depend on which other sessions happen to share a batch, nor on which
node runs the last stage of its pipeline for a given step.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Re-exported: the engine speaks of its sampling parameters through this module.
from hetnode.sampling_params import GREEDY as GREEDY
from hetnode.sampling_params import SamplingParams as SamplingParams

_MASK64 = (1 << 64) - 1

@dataclass(frozen=True, slots=True)
class Sample:
    token: int
    logprob: float | None  # log-probability of `token` under the model (before temperature, top-k, top-p)
    top_logprobs: tuple[tuple[int, float], ...] | None  # the k most likely tokens and their log-probabilities
    logits: torch.Tensor | None  # [V] float32


def uniform(seed: int, position: int) -> float:
    """A float in [0, 1) determined by (seed, position) alone: two rounds of splitmix64."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    for _ in range(2):
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return (z >> 11) / float(1 << 53)


def _draw(row: torch.Tensor, params: SamplingParams, u: float) -> int:
    # row: [V] float32 logits
    # The maximum off first: every scaled logit is then <= 0, so a small temperature sends the others to -inf
    # (probability 0) rather than overflowing them to +inf, where softmax computes inf - inf = NaN.
    scaled = (row - row.max()) / params.temperature
    if params.top_k or params.top_p < 1.0:
        k = min(params.top_k or scaled.numel(), scaled.numel())
        values, indices = torch.topk(scaled, k)  # sorted, most likely first
        probs = torch.softmax(values, dim=-1)
        if params.top_p < 1.0:
            # Keep a token while the mass before it is under top_p; the most likely one always stays.
            before = torch.cumsum(probs, dim=-1) - probs
            probs = probs.masked_fill(before >= params.top_p, 0.0)
    else:
        indices = None
        probs = torch.softmax(scaled, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    target = torch.tensor([u], dtype=cdf.dtype, device=cdf.device) * cdf[-1]
    choice = min(int(torch.searchsorted(cdf, target, right=True).item()), cdf.numel() - 1)
    # Never pick a token whose probability was cut to zero (searchsorted can land on one at a flat step).
    while probs[choice] == 0 and choice > 0:
        choice -= 1
    return int(indices[choice].item()) if indices is not None else choice


def sample(
    logits: torch.Tensor, params: Sequence[SamplingParams], positions: Sequence[int]
) -> list[Sample]:
    """One token per row of `logits` ([N, V], float32); positions[i] is the position the token will take."""
    # logits: [N, V]
    greedy = logits.argmax(dim=-1).tolist()  # one kernel for every greedy row of the batch
    want_logprobs = any(p.logprobs is not None for p in params)
    logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
    out: list[Sample] = []
    for i, (p, position) in enumerate(zip(params, positions, strict=True)):
        if p.greedy:
            token = int(greedy[i])
        else:
            u = uniform(p.seed, position) if p.seed is not None else random.random()
            token = _draw(logits[i], p, u)
        logprob, top = None, None
        if logprobs is not None and p.logprobs is not None:
            logprob = float(logprobs[i, token])
            if p.logprobs:
                values, indices = torch.topk(logprobs[i], p.logprobs)
                top = tuple(zip(indices.tolist(), values.tolist(), strict=True))
        out.append(Sample(token, logprob, top, logits[i].clone() if p.return_logits else None))
    return out
