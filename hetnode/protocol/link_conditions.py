"""The conditions of one network link: bandwidth, one-way latency and packet loss.

It lives here, below both users, because the link shaper (protocol/) emulates these conditions and the
cluster files (planner/) declare them; a lower layer must not import a higher one to learn the type.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkSpec:
    """One link's emulated or planned properties, the same in both directions."""

    bandwidth_mbps: float  # megabits per second; math.inf for an unlimited link
    latency_ms: float  # one way
    loss: float = 0.0  # probability that one packet is lost (and retransmitted)

    def __post_init__(self) -> None:
        if not self.bandwidth_mbps > 0:
            raise ValueError(f"bandwidth_mbps must be > 0, not {self.bandwidth_mbps}")
        if not 0 <= self.latency_ms < math.inf:
            raise ValueError(f"latency_ms must be finite and >= 0, not {self.latency_ms}")
        if not 0 <= self.loss < 1:
            raise ValueError(f"loss must be in [0, 1), not {self.loss}")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_mbps * 1e6 / 8

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3

    @property
    def unlimited(self) -> bool:
        """True when emulating this link would change nothing."""
        return math.isinf(self.bandwidth_mbps) and self.latency_ms == 0 and self.loss == 0


UNLIMITED = LinkSpec(bandwidth_mbps=math.inf, latency_ms=0.0)
