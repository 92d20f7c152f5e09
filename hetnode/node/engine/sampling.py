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

from hetnode.errors import ConfigError
from hetnode.models.config import bounded, check_bounds

_MASK64 = (1 << 64) - 1
# Below this a temperature samples as greedy. Logits are float32, so the division is done in float32, where a
# smaller divisor is subnormal or zero (1e-300 becomes 0.0) and the top logit's 0 / 0 would be NaN. Nothing is
# lost: at such a temperature logits as little as 1e-30 apart are 1e8 apart once scaled, so the softmax is
# one-hot already (ties aside, which greedy breaks toward the lower id).
_MIN_TEMPERATURE = float(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class SamplingParams:
    """How the last stage picks a session's next token."""

    temperature: float = bounded(0.0, "0 picks the most likely token (greedy); higher flattens", 0.0, 100.0)
    top_k: int = bounded(0, "sample among the k most likely tokens; 0: all", 0, 1 << 22)
    top_p: float = bounded(1.0, "sample from the smallest set whose probability reaches p", 1e-6, 1.0)
    seed: int | None = bounded(None, "same seed, same prompt -> same tokens; None: fresh randomness")
    stop_token_ids: tuple[int, ...] = bounded((), "a sampled token from this set ends the session")
    logprobs: int | None = bounded(None, "None: none; 0: the sampled token's; k: also the top k", 0, 20)
    return_logits: bool = bounded(False, "return the raw last-position logits (tests, debugging)")

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.seed is not None and not 0 <= self.seed <= _MASK64:
            raise ConfigError(f"seed must be in [0, 2**64), got {self.seed}", key="seed")

    @property
    def greedy(self) -> bool:
        return self.temperature < _MIN_TEMPERATURE or self.top_k == 1


GREEDY = SamplingParams()


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
