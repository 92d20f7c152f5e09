"""Helix's offline load: a fixed number of requests to start, then more as requests finish, under a KV bound.

Helix's simulator runs its offline experiments this way: it starts `start` (20) requests, and each time a query
completes it adds one new request while the scheduler's estimated KV use stays at or under `kv_use` (0.8). Its
queries are iterations (a prompt, or one decode step of one request), so `every="token"` gives each generated
token the chance to add one request; `every="finish"` reads "completion" as a request's end and then adds as many
as the bound allows. Measured on Helix's single cluster with its other settings, "finish" added requests in
bursts that queued their prompts at the first node (mean prompt latency 14.8 s against Helix's 2.96 s), "token"
less so (8.2 s; docs/simulator.md has the current figures). hetnode's own offline loop (`workload.offline`)
instead keeps a backlog queued at the scheduler, so a request's TTFT there includes queueing that Helix's never
has.

"Estimated KV use" is the scheduler's own estimate (prompt + expected output per running request, on every node
of its pipeline; `PipelineScheduler.kv_estimate`), as a share of each node's capacity; the loop looks at the
fullest node (`measure="max"`) or at all nodes' tokens together (`measure="total"`).

Pure: `to_add` decides from numbers; the runner asks it and starts the requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MEASURES = ("max", "total")
TRIGGERS = ("token", "finish")


@dataclass(frozen=True, slots=True)
class OfflineLoop:
    start: int = 20  # requests started at time 0
    kv_use: float = 0.8  # add requests while the estimated KV use is at or under this share
    every: str = "token"  # "token": each generated token may add one request; "finish": each end adds many
    measure: str = "max"  # "max": the fullest node's share; "total": all nodes' tokens over all capacity

    def __post_init__(self) -> None:
        if self.start < 1:
            raise ValueError(f"the offline loop must start at least one request, not {self.start}")
        if not 0 < self.kv_use <= 1:
            raise ValueError(f"the offline loop's KV bound must be in (0, 1], not {self.kv_use}")
        if self.every not in TRIGGERS:
            raise ValueError(f"every must be one of {', '.join(TRIGGERS)}, not {self.every!r}")
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
        """Whether one completion, having added `added` requests already, adds another at estimated use `use`."""
        return use <= self.kv_use and (self.every == "finish" or added < 1)
