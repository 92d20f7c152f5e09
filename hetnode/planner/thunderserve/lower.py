"""The lower level (§3.3) and with it f(x) of Algorithm 1: configure every group, estimate D, solve the LP.

Configurations are independent of the orchestration (§3.3), so each (GPUs, phase) is configured once and
remembered: the search revisits the same groups often. `fixed` layouts (lightweight rescheduling, §3.4) are
used as they are, in whichever phase the group now has.

The value of a deployment is (attainment, headroom): the LP's expected SLO attainment, and, to break its
ties (every deployment that serves a light load within the SLOs scores 1.0), the request rate the weaker
phase sustains, min(sum of prefill rates, sum of decode rates). None: some group has no layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from hetnode.planner.model import ModelSpec
from hetnode.planner.thunderserve.deployment import Deployment, Group
from hetnode.planner.thunderserve.gpus import GpuPool
from hetnode.planner.thunderserve.orchestration import LinkLoad, Routing, Solver, orchestrate
from hetnode.planner.thunderserve.parallel import DECODE, PREFILL, Configured, configure, performance
from hetnode.planner.thunderserve.settings import ThunderServeOptions
from hetnode.planner.thunderserve.slo import Handoff, Slo, attainment, decode_residency, kv_handoff, slo_for

Score = tuple[float, float]


@dataclass(frozen=True)
class Solution:
    deployment: Deployment
    prefill: tuple[tuple[Group, Configured], ...]
    decode: tuple[tuple[Group, Configured], ...]
    d: tuple[tuple[float, ...], ...]
    handoffs: tuple[tuple[Handoff, ...], ...]
    routing: Routing
    score: Score
    # requests/s each decode replica's KV sustains held from admission, at the capacity-proportional mix of pairs
    decode_capacity: tuple[float, ...] = ()


@dataclass
class LowerLevel:
    pool: GpuPool
    model: ModelSpec
    options: ThunderServeOptions
    fixed: Mapping[tuple[int, ...], Configured] = field(default_factory=dict)
    evaluations: int = 0
    _configs: dict[tuple[tuple[int, ...], str], Configured | None] = field(default_factory=dict)
    _handoffs: dict[tuple[tuple[int, ...], tuple[int, ...]], Handoff] = field(default_factory=dict)
    # The search revisits deployments (a flip and its undo, tabu memory being short): each is solved once.
    _solved: dict[Deployment, Solution | None] = field(default_factory=dict)
    _lp: Solver = field(default_factory=Solver)
    slo: Slo = field(init=False)

    def __post_init__(self) -> None:
        self.slo = slo_for(self.model, self.options)

    def configured(self, group: Group) -> Configured | None:
        key = (group.gpus, group.role)
        if key not in self._configs:
            given = self.fixed.get(group.gpus)
            if given is not None:
                # The layout stays; its costs are the same in either phase.
                self._configs[key] = Configured(given.layout, performance(self.pool, given.layout, self.model,
                                                                          self.options))
            else:
                self._configs[key] = configure(self.pool, group.gpus, group.role, self.model, self.options)
        return self._configs[key]

    def solve(self, dep: Deployment) -> Solution | None:
        if dep not in self._solved:
            self._solved[dep] = self._solve(dep)
        return self._solved[dep]

    def _solve(self, dep: Deployment) -> Solution | None:
        self.evaluations += 1
        configs = [(g, self.configured(g)) for g in dep.groups]
        if any(c is None for _, c in configs):
            return None
        prefill = tuple((g, c) for g, c in configs if c is not None and g.role == PREFILL)
        decode = tuple((g, c) for g, c in configs if c is not None and g.role == DECODE)
        traffic = self.options.traffic
        mu = [c.performance.prefill_rate for _, c in prefill]
        handoffs = tuple(tuple(self.handoff(p, d) for _, d in decode) for _, p in prefill)
        residency = [[decode_residency(p.performance, handoffs[i][j].seconds, q.performance, traffic.output_len,
                                       self.options.decode_booking)
                      for j, (_, q) in enumerate(decode)] for i, (_, p) in enumerate(prefill)]
        nu = [c.performance.decode_rate for _, c in decode]
        # What each decode replica's KV sustains with requests from the prefill replicas in proportion to their
        # capacity (the mix D is estimated at): its decode-alone rate over the mix's mean residency ratio.
        nu_mix = [nu[j] / _mix(mu, [residency[i][j] for i in range(len(prefill))]) for j in range(len(decode))]
        headroom = min(sum(mu), sum(nu_mix))
        # D at loads in proportion to capacity (orchestration.py says why), of what the LP can route at most:
        # past u x capacity it leaves requests unrouted, and those it routes see the capped load, not the
        # whole rate (which would make every D 0 on an overloaded phase).
        u = self.options.utilization
        load_p = [min(traffic.rate, u * sum(mu)) * x / sum(mu) for x in mu] if mu else []
        load_d = ([min(traffic.rate, u * sum(nu_mix)) * x / sum(nu_mix) for x in nu_mix] if nu_mix and sum(nu_mix) > 0
                  else [0.0] * len(nu))
        d = tuple(tuple(attainment(p.performance, load_p[i], q.performance, load_d[j], handoffs[i][j].seconds,
                                   self.slo, traffic.output_len, nu_mix[j], self.options.objective)
                        for j, (_, q) in enumerate(decode))
                  for i, (_, p) in enumerate(prefill))
        routing = orchestrate(d, mu, nu, traffic.rate, self.options.utilization, self._lp,
                              link_loads(self.pool, handoffs), residency)
        score = (round(routing.attainment, 9), headroom)
        return Solution(dep, prefill, decode, d, handoffs, routing, score, tuple(nu_mix))

    def handoff(self, prefill: Configured, decode: Configured) -> Handoff:
        key = (prefill.layout.gpus, decode.layout.gpus)
        if key not in self._handoffs:
            self._handoffs[key] = kv_handoff(self.pool, prefill.layout, decode.layout, self.model, self.options)
        return self._handoffs[key]


def _mix(weights: list[float], ratios: list[float]) -> float:
    """The mean of the finite `ratios` weighted by `weights` (inf when none is finite: nothing reaches it)."""
    finite = [(w, r) for w, r in zip(weights, ratios, strict=True) if math.isfinite(r)]
    total = sum(w for w, _ in finite)
    if not finite or total <= 0:
        return math.inf if not finite else max(r for _, r in finite)
    return sum(w * r for w, r in finite) / total


def link_loads(pool: GpuPool, handoffs: tuple[tuple[Handoff, ...], ...]) -> list[LinkLoad]:
    """The directed links the hand-offs of pairs (i, j) cross, each with what every pair puts on it, for the
    orchestration's capacity rows. A link is a GPU pair of the pool, as the cluster file states it and as the
    simulator queues it (one FIFO per direction)."""
    by_link: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
    for i, row in enumerate(handoffs):
        for j, handoff in enumerate(row):
            for a, b, nbytes in handoff.transfers:
                by_link.setdefault((a, b), []).append((i, j, nbytes))
    return [LinkLoad(pool.bandwidth[a][b], tuple(pairs)) for (a, b), pairs in sorted(by_link.items())]
