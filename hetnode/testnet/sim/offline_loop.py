"""Helix's offline load: a fixed number of requests to start, then more as requests finish, under a KV bound.

Helix's simulator runs its offline experiments this way: it starts `start` (20) requests, and each time one
finishes it adds new ones while the scheduler's estimated KV use stays at or under `kv_use` (0.8). hetnode's own
offline loop (`workload.offline`) instead keeps a backlog queued at the scheduler, so a request's TTFT there
includes queueing that Helix's never has.

"Estimated KV use" is the scheduler's own estimate (prompt + expected output per running request, on every node
of its pipeline; `PipelineScheduler.kv_estimate`), as a share of each node's capacity; the loop looks at the
fullest node (`measure="max"`) or at all nodes' tokens together (`measure="total"`). `per_finish` bounds how
many requests one finish adds (None: as many as the bound allows).

Pure: `to_add` decides from numbers; the runner asks it and starts the requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MEASURES = ("max", "total")


@dataclass(frozen=True, slots=True)
class OfflineLoop:
    start: int = 20  # requests started at time 0
    kv_use: float = 0.8  # add requests while the estimated KV use is at or under this share
    per_finish: int | None = None  # most requests one finish adds (None: no bound but kv_use)
    measure: str = "max"  # "max": the fullest node's share; "total": all nodes' tokens over all capacity

    def __post_init__(self) -> None:
        if self.start < 1:
            raise ValueError(f"the offline loop must start at least one request, not {self.start}")
        if not 0 < self.kv_use <= 1:
            raise ValueError(f"the offline loop's KV bound must be in (0, 1], not {self.kv_use}")
        if self.per_finish is not None and self.per_finish < 1:
            raise ValueError(f"per_finish must be >= 1 or None, not {self.per_finish}")
        if self.measure not in MEASURES:
            raise ValueError(f"measure must be one of {', '.join(MEASURES)}, not {self.measure!r}")

    def use(self, nodes: Iterable[tuple[float, int | None]]) -> float:
        """Estimated KV use from (estimated tokens, capacity or None: unlimited) per node."""
        known = [(t, c) for t, c in nodes if c]
        if not known:
            return 0.0
        if self.measure == "max":
            return max(t / c for t, c in known)
        return sum(t for t, _ in known) / sum(c for _, c in known)

    def admits(self, use: float, added: int) -> bool:
        """Whether one finish, having added `added` requests already, adds another at estimated use `use`."""
        return use <= self.kv_use and (self.per_finish is None or added < self.per_finish)
