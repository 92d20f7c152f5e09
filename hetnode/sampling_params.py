"""How a request wants its tokens picked: the sampling parameters, apart from the sampler that applies them.

The coordinator validates and forwards these without loading torch; the engine's sampler
(`hetnode.node.engine.sampling`) applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetnode.errors import ConfigError
from hetnode.models.config import bounded, check_bounds

_MASK64 = (1 << 64) - 1

# Below this a temperature samples as greedy. Logits are float32, so the division is done in float32, where a
# smaller divisor is subnormal or zero (1e-300 becomes 0.0) and the top logit's 0 / 0 would be NaN. Nothing is
# lost: at such a temperature logits as little as 1e-30 apart are 1e8 apart once scaled, so the softmax is
# one-hot already (ties aside, which greedy breaks toward the lower id).
_MIN_TEMPERATURE = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny, without importing torch here


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



__all__ = ["GREEDY", "SamplingParams"]
