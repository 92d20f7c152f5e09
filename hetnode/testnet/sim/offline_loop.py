"""Helix's offline load: a fixed number of requests to start, then more as requests finish, under a KV bound.

Helix's simulator runs its offline experiments this way: it starts `start` (20) requests, and each time a query
completes it adds one new request while the scheduler's estimated KV use stays at or under `kv_use` (0.8). What
"completes" means is in its artifact (`simulator/trace_generator/simulator_query_feeder.py`,
`OfflineRequestFeeder.check_launch_new_query`, which the cluster simulator calls when a request's prompt phase
ends and when its last decode ends): `every="prompt_or_end"` gives a request's first token and its last one
each the chance to add one request. The other triggers are the readings tried before the artifact was read:
`every="token"` gives each generated token that chance, `every="finish"` adds as many as the bound allows at
each end. Measured on Helix's single cluster with its other settings (docs/simulator.md has the figures),
"finish" added requests in bursts that queued their prompts at the first node, "token" filled the pools in
the first 30 s and queued the prompts there through the first measured minute. hetnode's own offline loop
(`workload.offline`) instead keeps a backlog queued at the scheduler, so a request's TTFT there includes
queueing that Helix's never has.

`every="replace"` is the feeder Helix's artifact runs for the schedulers that cannot refuse a request (its Swarm,
random and shortest-queue schedulers; `check_launch_new_query`: "we can only set a manual max query count"): the
`start` requests, and each request's end adds one in its place, whatever the KV holds, so that `start` requests
stay in flight (a prompt's end adds none). `start` is then that hand-set count; `kv_use` and `measure` are unused.

"Estimated KV use" is the scheduler's own estimate (prompt + expected output per running request, on every node
of its pipeline; `PipelineScheduler.kv_estimate`), as a share of capacity: of the fullest node
(`measure="max"`), of all nodes' tokens together (`measure="total"`), or Helix's `bottleneck_usage`
(`measure="layer"`, in the artifact's `kv_expectation.py`): for each layer, the tokens charged on the nodes
holding it over their capacity together, and the fullest layer.

Which request comes next: `lengths="order"` takes the workload's requests in order (cycling), as hetnode's own
loop does; `lengths="drawn"` draws each one's (input, output) pair at random from the whole workload, as Helix's
feeder does (`OfflineRequestFeeder` asks its `LengthSampler`, `length_sampler.py`: `random.randint` over the
trace's pairs, seeded with the run's seed). The two differ where the trace's first requests are not like the
whole: the conversation trace's first 800 have a mean output of 272 tokens, the whole trace 232
(docs/simulator.md measures what that moves).

When: `delay_s` is how long after the event that adds it a request arrives, and the spacing of the first `start`
ones; Helix's feeder issues each query 0.1 s after its trigger and its first ones 0.1 s apart (0: at once). With
drawn lengths it is what brings the offline figures to Helix's (docs/simulator.md).

Pure: `admits` decides from numbers, `index` picks the next request; the runner asks them and starts the
requests.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MEASURES = ("max", "total", "layer")
TRIGGERS = ("token", "finish", "prompt_or_end", "replace")
LENGTHS = ("order", "drawn")


@dataclass(frozen=True, slots=True)
class OfflineLoop:
    start: int = 20  # requests started at time 0
    kv_use: float = 0.8  # add requests while the estimated KV use is at or under this share
    # "token": each generated token may add one request; "finish": each end adds many; "prompt_or_end": a
    # request's first token (its prompt done) and its last may each add one (Helix's); "replace": each end adds
    # one whatever the KV holds, `start` staying in flight (Helix's feeder for the schedulers that cannot refuse)
    every: str = "prompt_or_end"
    # "max": the fullest node's share; "total": all nodes' tokens over all capacity; "layer": per layer over
    # the nodes holding it, the fullest layer (Helix's)
    measure: str = "layer"
    # "order": the workload's requests in order, cycling; "drawn": each one drawn at random (Helix's sampler)
    lengths: str = "order"
    # Seconds from the event that adds a request to its arrival, and between the first `start` requests (0:
    # at once, all at time 0). Helix's feeder issues each new query 0.1 s after its trigger and its first ones
    # 0.1 s apart (`OfflineRequestFeeder.auto_simulate`, `check_launch_new_query`).
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.start < 1:
            raise ValueError(f"the offline loop must start at least one request, not {self.start}")
        if not 0 < self.kv_use <= 1:
            raise ValueError(f"the offline loop's KV bound must be in (0, 1], not {self.kv_use}")
        if self.every not in TRIGGERS:
            raise ValueError(f"every must be one of {', '.join(TRIGGERS)}, not {self.every!r}")
        if self.measure not in MEASURES:
            raise ValueError(f"measure must be one of {', '.join(MEASURES)}, not {self.measure!r}")
        if not 0 <= self.delay_s < 60:
            raise ValueError(f"the offline loop's delay must be in [0, 60) s, not {self.delay_s}")
        if self.lengths not in LENGTHS:
            raise ValueError(f"lengths must be one of {', '.join(LENGTHS)}, not {self.lengths!r}")

    def use(self, nodes: Iterable[tuple[float, int | None]],
            layers: Sequence[tuple[int, int]] | None = None) -> float:
        """Estimated KV use from (estimated tokens, capacity or None: unlimited) per node; "layer" also needs
        each node's layers [first, last), in the same order."""
        estimate = list(nodes)
        known = [(t, c) for t, c in estimate if c]
        if not known:
            return 0.0
        if self.measure == "max":
            return max(t / c for t, c in known)
        if self.measure == "total":
            return sum(t for t, _ in known) / sum(c for _, c in known)
        if layers is None or len(layers) != len(estimate):
            raise ValueError("the per-layer KV use needs each node's layer range")
        shares = []
        for holders in layer_holders(tuple(layers)):
            tokens = [estimate[i][0] for i in holders if estimate[i][1]]
            if tokens:
                shares.append(sum(tokens) / sum(estimate[i][1] or 0 for i in holders))
        return max(shares)

    def admits(self, use: float, added: int) -> bool:
        """Whether one completion, having added `added` requests already, adds another at estimated use `use`."""
        if not self.bounded:
            return added < 1
        return use <= self.kv_use and (self.every == "finish" or added < 1)

    @property
    def bounded(self) -> bool:
        """Whether the KV estimate bounds the loop; one that replaces each finished request keeps a fixed count in
        flight instead, and starts requests the scheduler has to queue."""
        return self.every != "replace"

    def index(self, started: int, n: int, rng: random.Random) -> int:
        """Which of the workload's `n` requests the loop's `started`-th request takes."""
        return rng.randrange(n) if self.lengths == "drawn" else started % n

    @property
    def on_prompt(self) -> bool:
        """Whether a request's first token (its prompt done) is a chance to add one."""
        return self.every == "prompt_or_end"


@functools.lru_cache(maxsize=16)
def layer_holders(layers: tuple[tuple[int, int], ...]) -> tuple[tuple[int, ...], ...]:
    """Each distinct set of nodes (indices into `layers`) that holds some layer: the loop asks for the per-layer
    use at every prompt's end and request's end, over a layout that does not change during a run."""
    held: dict[int, list[int]] = {}
    for i, (first, last) in enumerate(layers):
        for layer in range(first, last):
            held.setdefault(layer, []).append(i)
    return tuple(dict.fromkeys(tuple(v) for v in held.values()))

