"""A node's recent throughput: tokens per second of its steps, as a moving average (SWARM's rate estimate).

The runtime's batch loop feeds it every step it runs and reports it in heartbeats; the simulated node feeds it
the steps it prices. The swarm scheduler draws a node with probability proportional to it.
"""

from __future__ import annotations


class StepRate:
    def __init__(self, initial: float = 0.0, weight: float = 0.2) -> None:
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], not {weight}")
        self.value = initial  # tokens/s; the initial guess (T_j, or 0: nothing measured) until steps come in
        self.weight = weight

    def step(self, tokens: int, seconds: float) -> None:
        """A step ran `tokens` tokens in `seconds` (a zero-length step says nothing and is skipped)."""
        if seconds > 0:
            self.value += self.weight * (tokens / seconds - self.value)
