"""The lower level (§3.3) and with it f(x) of Algorithm 1: configure every group, estimate D, solve the LP.

Configurations are independent of the orchestration (§3.3), so each (GPUs, phase) is configured once and
remembered: the search revisits the same groups often. `fixed` layouts (lightweight rescheduling, §3.4) are
used as they are, in whichever phase the group now has.

The value of a deployment is (attainment, headroom): the expected SLO attainment of its routing, D taken at the
loads that routing puts on each replica (`_solve`), to SCORE_RESOLUTION, and, to break its ties (deployments that
serve a light load within the SLOs score alike), the request rate the weaker phase sustains, min(sum of prefill
rates, sum of decode rates). None: some group has no layout.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from hetnode.planner.model import ModelSpec
from hetnode.planner.thunderserve.decode_queue import room_at, sustained
from hetnode.planner.thunderserve.deployment import Deployment, Group
from hetnode.planner.thunderserve.first_token import (
    Array,
    LengthSample,
    StationCurve,
    first_token_s,
    length_sample,
    station_curve,
)
from hetnode.planner.thunderserve.gpus import GpuPool
from hetnode.planner.thunderserve.orchestration import LinkLoad, Routing, Solver, orchestrate, pair_shares
from hetnode.planner.thunderserve.parallel import DECODE, PREFILL, Configured, configure, performance, prefill_stations
from hetnode.planner.thunderserve.settings import ThunderServeOptions
from hetnode.planner.thunderserve.slo import (
    Handoff,
    Slo,
    attainment,
    decode_residency,
    decode_tpot,
    kv_handoff,
    moved,
    slo_for,
)

Score = tuple[float, float]
# Attainments closer than this score the same, and the headroom decides: D is a mean over `first_token.SAMPLE`
# requests, and a deployment a hair better by it at the planned rate is no better a choice than one with far
# more room.
SCORE_RESOLUTION = 0.01
ROUNDS = 2  # times D is estimated again at the loads of the LP's routing (`LowerLevel._solve`)
# A replica the routing leaves idle is judged at this share of its capacity, not at none: idle, it would attain
# nothing (no arrivals, no first tokens) and the LP would never try it again.
FLOOR = 0.05
LOAD_STEP = 0.02  # queues are simulated at loads 2% apart (`_grid`)


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
    # A prefill layout's station times by prompt length, and its sample's first tokens by load: the search meets
    # the same replica at the same load often (a deployment's loads follow from its capacities).
    _curves: dict[tuple[int, ...], StationCurve] = field(default_factory=dict)
    _first_tokens: dict[tuple[tuple[int, ...], float], Array] = field(default_factory=dict)
    # a decode layout's sustained rate, and its sample's waits for room by load and residency
    _sustained: dict[tuple[int, ...], float] = field(default_factory=dict)
    _waits: dict[tuple[tuple[int, ...], float, float], Array] = field(default_factory=dict)
    slo: Slo = field(init=False)
    sample: LengthSample = field(init=False)
    # the KV each sampled request holds on average while it decodes: its prompt and half its output
    need: Array = field(init=False)

    def __post_init__(self) -> None:
        self.slo = slo_for(self.model, self.options)
        self.sample = length_sample(self.options.traffic, self.options.seed)
        self.need = self.sample.inputs + self.sample.outputs / 2

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
        # what each decode replica sustains: its KV at the mean context, or less where requests of the traffic's
        # spread of lengths queue for it (`decode_queue`)
        nu = [min(c.performance.decode_rate, self.decode_sustained(c)) for _, c in decode]
        # What each decode replica's KV sustains with requests from the prefill replicas in proportion to their
        # capacity (the mix D is estimated at): its decode-alone rate over the mix's mean residency ratio.
        nu_mix = [nu[j] / _mix(mu, [residency[i][j] for i in range(len(prefill))]) for j in range(len(decode))]
        headroom = min(sum(mu), sum(nu_mix))
        # D first at loads in proportion to capacity (orchestration.py says why), of what the LP can route at most:
        # past u x capacity it leaves requests unrouted, and those it routes see the capped load, not the whole
        # rate (which would make every D 0 on an overloaded phase); each prefill replica's requests split over the
        # decode replicas in the same proportion.
        u = self.options.utilization
        load_p = [min(traffic.rate, u * sum(mu)) * x / sum(mu) for x in mu] if mu else []
        load_d = ([min(traffic.rate, u * sum(nu_mix)) * x / sum(nu_mix) for x in nu_mix] if nu_mix and sum(nu_mix) > 0
                  else [0.0] * len(nu))
        share = [[x / sum(nu_mix) if sum(nu_mix) > 0 else 0.0 for x in nu_mix] for _ in prefill]
        links = link_loads(self.pool, handoffs)
        d = self._estimate(prefill, decode, handoffs, mu, nu, nu_mix, load_p, load_d, share)
        routing = orchestrate(d, mu, nu, traffic.rate, u, self._lp, links, residency)
        # The LP fills the pairs D rates best up to u x capacity, where queues form that D, estimated at other
        # loads, did not see (measured on coding, issue 14: 95% of the requests on one prefill replica, its first
        # tokens 4.0 s where D had 2.4 s). So D again at the loads of the routing, and the LP again on it: the
        # routing kept is the one that attains most by D at its own loads.
        best: tuple[float, Routing, tuple[tuple[float, ...], ...]] | None = None
        for _ in range(ROUNDS if prefill and decode else 0):
            z = pair_shares(routing) * traffic.rate
            load_p = [max(float(z[i].sum()), FLOOR * mu[i]) for i in range(len(prefill))]
            load_d = [max(float(z[:, j].sum()), FLOOR * nu_mix[j]) for j in range(len(decode))]
            share = [list(row) for row in routing.decode_share]
            own = self._estimate(prefill, decode, handoffs, mu, nu, nu_mix, load_p, load_d, share)
            attained = float((np.array(own) * z).sum() / traffic.rate) if z.size else 0.0
            if best is None or attained > best[0] + 1e-12:
                best = (attained, routing, own)
            routing = orchestrate(own, mu, nu, traffic.rate, u, self._lp, links, residency)
        if best is not None:
            attained, kept, d = best
            routing = Routing(kept.prefill_share, kept.decode_share, attained, kept.routed)
        score = (round(routing.attainment / SCORE_RESOLUTION) * SCORE_RESOLUTION, headroom)
        return Solution(dep, prefill, decode, d, handoffs, routing, score, tuple(nu_mix))

    def _estimate(self, prefill: tuple[tuple[Group, Configured], ...], decode: tuple[tuple[Group, Configured], ...],
                  handoffs: tuple[tuple[Handoff, ...], ...], mu: list[float], nu: list[float], nu_mix: list[float],
                  load_p: list[float], load_d: list[float],
                  share: list[list[float]]) -> tuple[tuple[float, ...], ...]:
        """D at these loads (requests/s per replica) and shares (of each prefill replica's requests per pair)."""
        traffic = self.options.traffic
        first = [self.first_token(p, load_p[i]) for i, (_, p) in enumerate(prefill)]
        moves = [[moved(first[i], self.sample, share[i][j], load_p[i], handoffs[i][j]) for j in range(len(decode))]
                 for i in range(len(prefill))]
        room = []
        for j, (_, q) in enumerate(decode):
            # A decode replica holds a request's KV through its hand-off too: the mix's residency (the hand-offs
            # as their links would carry them alone) and what they wait on their links besides.
            residency = nu[j] / nu_mix[j] if nu_mix[j] > 0 else math.inf
            weights = [load_p[i] * share[i][j] for i in range(len(prefill))]
            waited = [max(0.0, float(moves[i][j].seconds.mean()) - handoffs[i][j].seconds)
                      if moves[i][j].seconds.size and math.isfinite(handoffs[i][j].seconds) else 0.0
                      for i in range(len(prefill))]
            decode_s = traffic.output_len * decode_tpot(q.performance, load_d[j], traffic.output_len)
            if sum(weights) > 0 and decode_s > 0:
                residency += sum(w * x for w, x in zip(weights, waited, strict=True)) / sum(weights) / decode_s
            room.append(self.decode_wait(q, load_d[j], residency))
        return tuple(tuple(attainment(mu[i], load_p[i], q.performance, load_d[j], handoffs[i][j], self.slo,
                                      traffic.output_len, first[i], self.sample, moves[i][j], room[j], nu_mix[j],
                                      self.options.objective)
                           for j, (_, q) in enumerate(decode))
                     for i in range(len(prefill)))

    def decode_sustained(self, decode: Configured) -> float:
        """Requests/s this decode replica's KV sustains for the sample's requests, each held for its decode alone
        (`decode_queue.sustained`; `Performance.decode_rate` is the same at the mean context)."""
        gpus = decode.layout.gpus
        if gpus not in self._sustained:
            perf, sample = decode.performance, self.sample
            self._sustained[gpus] = sustained(self.need, sample.outputs * perf.tpot[-1][1], perf.kv_tokens,
                                              self.options.max_batch)
        return self._sustained[gpus]

    def decode_wait(self, decode: Configured, load: float, residency: float) -> Array:
        """How long each sampled request waits for room on this decode replica offered `load` requests/s, each
        holding its KV `residency` times its decode (`decode_queue.room_at`)."""
        load, residency = _grid(load), _grid(residency)
        key = (decode.layout.gpus, load, residency)
        if key not in self._waits:
            perf, sample = decode.performance, self.sample
            if not (load > 0 and math.isfinite(residency)):
                self._waits[key] = np.zeros(len(sample.inputs))
            else:
                arrivals = sample.arrivals / load
                hold = sample.outputs * decode_tpot(perf, load, self.options.traffic.output_len) * residency
                self._waits[key] = room_at(arrivals, self.need, hold, perf.kv_tokens,
                                           self.options.max_batch) - arrivals
        return self._waits[key]

    def first_token(self, prefill: Configured, load: float) -> Array:
        """The sample's times to first token on this prefill replica at `load` requests/s (`first_token`)."""
        layout = prefill.layout
        load = _grid(load)
        key = (layout.gpus, load)
        if key not in self._first_tokens:
            if layout.gpus not in self._curves:
                self._curves[layout.gpus] = station_curve(
                    lambda tokens: prefill_stations(self.pool, layout, self.model, tokens), self.sample)
            self._first_tokens[key] = first_token_s(self._curves[layout.gpus], self.sample, load)
        return self._first_tokens[key]

    def handoff(self, prefill: Configured, decode: Configured) -> Handoff:
        key = (prefill.layout.gpus, decode.layout.gpus)
        if key not in self._handoffs:
            self._handoffs[key] = kv_handoff(self.pool, prefill.layout, decode.layout, self.model, self.options)
        return self._handoffs[key]


def _grid(load: float) -> float:
    """`load` to within LOAD_STEP of itself, on a fixed grid: the search and the rounds of `_solve` meet the same
    replica at nearly the same load often, and its queues are simulated once per grid point."""
    if not (load > 0 and math.isfinite(load)):
        return load
    return math.exp(round(math.log(load) / LOAD_STEP) * LOAD_STEP)


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
