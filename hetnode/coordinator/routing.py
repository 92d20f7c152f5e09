"""The baseline routing policies of Helix §6.7, beside Helix's own IWRR (`scheduler.py`), and a factory.

All of them build per-request pipelines with the same machinery (`PipelineScheduler`: the topology walk
that routes around dead ends, the KV estimate and its high-water mask, the FIFO queue); they differ only
in which unmasked candidate a vertex takes:

- random: uniformly at random.
- shortest-queue: the candidate with the shortest queue (Helix's "SQ"), from an injected `queue_len(node)`.
- swarm: SWARM parallelism's stochastic wiring: at random, with probability proportional to the candidate's
  recently measured throughput, from an injected `throughput(node)`; or, given `delay(a, b)`, inversely to the
  time requests recently took from this vertex through the link to the candidate and its step (SWARM's own
  per-peer estimate, which sees the network as well as the peer).

By default the baselines walk every valid connection of the placement (`edges="topology"`), as they would
when run on Helix's placement without its flows (§6.7: "all methods use the model placement found by
Helix"); `edges="flows"` restricts them to the edges that carry flow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Unpack

from hetnode.coordinator.cronus_scheduler import CronusScheduler
from hetnode.coordinator.ecoserve_scheduler import EcoServeScheduler
from hetnode.coordinator.pair_schedulers import RandomPairScheduler, TstpScheduler
from hetnode.coordinator.pool_scheduler import PoolScheduler
from hetnode.coordinator.scheduler import EdgeSet, IwrrScheduler, PipelineScheduler, QueuedScheduler, SchedulerOptions
from hetnode.coordinator.split_scheduler import SplitScheduler
from hetnode.errors import ConfigError
from hetnode.planner.plan import SOURCE, PlacementPlan


class RandomScheduler(PipelineScheduler):
    """Uniformly random among the unmasked candidates of every vertex."""

    name = "random"

    def __init__(self, plan: PlacementPlan, *, edges: EdgeSet = "topology",
                 **options: Unpack[SchedulerOptions]) -> None:
        super().__init__(plan, edges=edges, **options)

    def _pick(self, vertex: int, eligible: list[int], work: float) -> int:
        return self._rng.choice(eligible)


class ShortestQueueScheduler(PipelineScheduler):
    """At every vertex, the candidate whose queue is shortest; ties broken at random (seeded).

    `queue_len(node)` should count what is already routed to the node and not yet done (the simulator's or
    the heartbeats' queued tokens or requests). Without it, the scheduler's own count of running requests
    through each node stands in.
    """

    name = "shortest-queue"

    def __init__(self, plan: PlacementPlan, *, queue_len: Callable[[str], float] | None = None,
                 edges: EdgeSet = "topology", **options: Unpack[SchedulerOptions]) -> None:
        super().__init__(plan, edges=edges, **options)
        self._queue_len_of = queue_len

    def _pick(self, vertex: int, eligible: list[int], work: float) -> int:
        cands = self._cands[vertex]
        if self._queue_len_of is None:
            lengths: list[float] = [self._kv_requests[cands[p]] for p in eligible]
        else:
            lengths = [self._queue_len_of(self._node_name(cands[p])) for p in eligible]
        shortest = min(lengths)
        ties = [p for p, length in zip(eligible, lengths, strict=True) if length == shortest]
        return ties[0] if len(ties) == 1 else self._rng.choice(ties)


class SwarmScheduler(PipelineScheduler):
    """SWARM's stochastic wiring: a candidate drawn with probability proportional to its measured throughput.

    `throughput(node)` is the recent measured rate (any unit, e.g. tokens/s, as SWARM's moving average of
    the time each request took). A candidate with nothing measured yet (<= 0 or not finite) counts as the
    mean of its measured siblings, so that new nodes get tried; with nothing measured at all the draw is
    uniform. Without `throughput` it is always uniform.

    `delay(a, b)`, where given, replaces the node's rate by what SWARM itself measures: seconds a request recently
    took from `a` (a node, or SOURCE for the coordinator) through the link to candidate `b` until b's step ran it
    (Appendix C of the SWARM paper; Helix's simulator keeps it per sender and link, `SwarmNode.ema`, and picks a
    link as often as 1 / that). The network is in it: on geo-distributed clusters a candidate across a slow
    region boundary is taken less often than one beside the sender, where the node's rate alone cannot tell them
    apart. A delay <= 0 or not finite counts as unmeasured, as above.
    """

    name = "swarm"

    def __init__(self, plan: PlacementPlan, *, throughput: Callable[[str], float] | None = None,
                 delay: Callable[[str, str], float] | None = None, edges: EdgeSet = "topology",
                 **options: Unpack[SchedulerOptions]) -> None:
        super().__init__(plan, edges=edges, **options)
        self._throughput_of = throughput
        self._delay_of = delay

    def _pick(self, vertex: int, eligible: list[int], work: float) -> int:
        cands, name = self._cands[vertex], self._node_name
        if self._delay_of is not None:
            here = SOURCE if vertex == self._source else name(vertex)
            delays = [self._delay_of(here, name(cands[p])) for p in eligible]
            rates = [1.0 / d if 0 < d < math.inf else 0.0 for d in delays]
        elif self._throughput_of is not None:
            rates = [self._throughput_of(name(cands[p])) for p in eligible]
        else:
            return self._rng.choice(eligible)
        measured = [r for r in rates if 0 < r < math.inf]
        if not measured:
            return self._rng.choice(eligible)
        total = sum(measured)
        if len(measured) < len(rates):
            fill = total / len(measured)
            rates = [r if 0 < r < math.inf else fill for r in rates]
            total += fill * (len(rates) - len(measured))
        x = self._rng.random() * total
        for p, r in zip(eligible, rates, strict=True):
            x -= r
            if x < 0:
                return p
        return eligible[-1]  # x landed on the total itself, by rounding


SCHEDULERS: dict[str, type[PipelineScheduler]] = {
    cls.name: cls for cls in (IwrrScheduler, RandomScheduler, ShortestQueueScheduler, SwarmScheduler)
}


def scheduler_names() -> list[str]:
    return list(SCHEDULERS)


Scheduler = QueuedScheduler


# The policies of a phase-split plan: CLS's pairs, or Splitwise's pools (which lend replicas across roles).
# ThunderServe's plans also by their orchestration (tstp) or, for its ablation, by random pairs.
SPLIT_SCHEDULERS: dict[str, type[SplitScheduler]] = {
    cls.name: cls for cls in (SplitScheduler, PoolScheduler, TstpScheduler, RandomPairScheduler)}


def policy_names() -> list[str]:
    """Every name an operator's `--scheduler` may give: the pipeline policies and the phase-split ones."""
    return [*SCHEDULERS, *SPLIT_SCHEDULERS]


def scheduler_for(plan: PlacementPlan, name: str) -> str:
    """The policy a plan is routed by, for the operator's `--scheduler name`: a phase-split plan's replicas by
    `name` when that is a phase-split policy, else by CLS; any other plan by `name`, or by Helix's IWRR when
    `name` is a phase-split policy (a re-plan may change the method, and the operator's choice then applies to
    the plans it fits)."""
    if plan.method == "cronus":
        return CronusScheduler.name
    if plan.method == "ecoserve":
        return EcoServeScheduler.name
    if plan.replicas:
        if name in SPLIT_SCHEDULERS:
            return name
        # A ThunderServe plan carries the orchestration it was searched with: routed by it unless told otherwise.
        return TstpScheduler.name if plan.orchestration is not None else SplitScheduler.name
    return IwrrScheduler.name if name in SPLIT_SCHEDULERS else name


def make_scheduler(name: str, plan: PlacementPlan, **kwargs: Any) -> Scheduler:
    """A policy by name ("iwrr", "random", "shortest-queue", "swarm"; "cls" or "splitwise" for a phase-split
    plan) with its keyword options.

    Common options: kv_capacity, high_water, avg_output_len, queue_limit, seed; the baselines also take
    edges, shortest-queue queue_len, swarm throughput; cls takes regions. Raises ConfigError for an unknown
    name, or a policy that does not fit the plan's shape.
    """
    key = name.strip().lower()
    if key == CronusScheduler.name or plan.method == "cronus":
        if key != CronusScheduler.name or plan.method != "cronus":
            raise ConfigError(f"scheduler {name!r} cannot route plan {plan.method!r}: a Cronus plan is routed by "
                              "'cronus', and only such a plan")
        return CronusScheduler(plan, **kwargs)
    if key == EcoServeScheduler.name or plan.method == "ecoserve":
        if key != EcoServeScheduler.name or plan.method != "ecoserve":
            raise ConfigError(f"scheduler {name!r} cannot route plan {plan.method!r}: an EcoServe plan is routed "
                              "by 'ecoserve', and only such a plan")
        return EcoServeScheduler(plan, **kwargs)
    if key in SPLIT_SCHEDULERS or plan.replicas:
        if key not in SPLIT_SCHEDULERS or not plan.replicas:
            raise ConfigError(f"scheduler {name!r} cannot route plan {plan.method!r}: a phase-split plan is routed "
                              f"by {' or '.join(map(repr, SPLIT_SCHEDULERS))}, and only such a plan")
        return SPLIT_SCHEDULERS[key](plan, **kwargs)
    cls = SCHEDULERS.get(key)
    if cls is None:
        raise ConfigError(f"unknown scheduler {name!r}; choose one of: {', '.join(SCHEDULERS)}")
    return cls(plan, **kwargs)
