"""Model placement: `plan_placement(cluster, model, profiles, method=...)` -> PlacementPlan.

Methods: "helix" (Helix §4.4's MILP and the search around it), and the baselines of Helix §6: "petals",
"swarm", "sp" (separate pipelines) and "sp+" (separate pipelines plus a mixed one from the leftovers), from
heuristics.py. Every plan's flow is the max flow of its placement by `flowgraph.evaluate` over all of the
cluster's connections: the solvers' objectives are only ever used as bounds.

"helix" runs, within `time_limit_s`, stopping as soon as its best placement is within `mip_gap` of its
best upper bound:

1. the four heuristics: the best (every node placed: a node a heuristic leaves out takes one layer where
   coverage is least, which never lowers a max flow) is the incumbent, and the warm start;
2. stage placements (stages.py): the best placement in which consecutive groups of nodes hold whole stages,
   by device class (a decomposition of the compute problem), and on a multi-region cluster branch placements
   (branches.py: regions side by side, each running the first layers on its share of the flow and feeding one
   region's tail) and then region by region, in series, with the links between the regions checked;
3. local search (local_search.py) from the best placement and from the best heuristic's;
4. the coverage bound (coverage.py): a proof that no placement carries the next level, first asked at the
   best flow plus the gap;
5. until the time is up, neighbourhood search with exact neighbourhood MILPs (lns.py) from the best
   placement, each round followed by a round of local search from one of a few starts; for a cluster of at
   most SMALL_CLUSTER nodes (or without LNS) the §4.4 MILP (milp.py) instead, from the best placement, over
   the pruned connections when pruning is on; it proves optimality on small clusters.

The plan is never worse than the best heuristic: a placement replaces the incumbent only with a higher max
flow, and a heuristic's plan is returned when nothing beat it. Its upper bound is the least of the compute
bound (flowgraph.upper_bound), the region flow bound (bounds.py: where links limit the flow), the coverage
bound and the §4.4 model's dual bound (from a solve over every connection).

Determinism: every step runs to a deterministic limit of its own (`WORK`: search states, branch-and-bound
nodes, flow evaluations), so the search is one fixed sequence of steps for a given seed and the clock only
decides how far along it a run gets: a longer or quieter run continues the same sequence, and keeps
improving past a minute when given the time. With `work_limit` (rounds of step 5) the plan is a function of
the inputs alone, whatever the machine's load, as long as the time limit (then a safety net) does not cut
in. Without one, time shares cap each phase and a step the clock does cut short (a loaded machine, a short
limit) makes that run differ; the plan's notes count them.

What each technique buys (scripts/bench_planner.py --ablation; Helix's measured profiles, LLaMA-70B, one
core, 60 s on helix-geo (24 nodes), 105 s on helix-hetero (42); the plan never drops below the best
heuristic, 2289 and 15409 tokens/s, so the columns say what the search itself reached):

    technique (added in turn)                         helix-geo            helix-hetero
    §4.4 as printed, cold                             0 (no placement)     0
    + objective cut F <= compute bound                0                    0
    tight formulation (flow bounds f <= d min(S,      0                    1683
      T_max), big-M L-1 / L-2 / L, compute cut)
    + symmetry breaking (ordered s_i)                 0                    0
    + warm start from the best heuristic              2289 (kept)          15409 (kept)
    + neighbourhood search (LNS)                      4578                 16939
    + local search                                    6506                 16729
    + stage placements                                6104                 17460
    + coverage bound (everything)                     6104, bound 9485     17460, bound 17839
    pruning the searches' graph to degree 12          4578                 13922

The LP relaxation of the §4.4 model as printed is 790120 tokens/s on helix-geo (80x the compute bound of
9877) and 1427111 on helix-hetero (80x 17839); the tight formulation's is the compute bound itself, with 40%
fewer variables (1528 against 2480; 776 integer against 1880). Neither moves a good warm start by branch
and bound in these budgets: HiGHS explores a few thousand nodes of a relaxation that knows nothing about
where layers sit. What moves it is search over exact neighbourhoods (LNS: +100% and +10% over the best
heuristic), fast local moves (+40% more on helix-geo) and the stage decomposition (+4% more on helix-hetero,
within 2.1% of the compute bound). The symmetry rows and the objective cut change nothing measurable here
(HiGHS detects the symmetry itself); the coverage bound tightens helix-geo's bound from 9877 to 9485 and
proves helix-single LLaMA-70B's heuristic plan within 0.6% of optimal. Pruning to degree 12 (Helix §4.5)
made every search worse when it pruned the graph they search (-25% and -20%: the flows of these placements
spread over many links), so it now prunes only the §4.4 model, whose size grows with the connections. On
the tiny clusters of the tests the §4.4 model (either formulation) solves to the brute-force optimum in
under a second.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from hetnode.errors import ConfigError
from hetnode.planner import flowgraph
from hetnode.planner.bounds import region_flow_bound
from hetnode.planner.branches import Branches, branch_placements
from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.coverage import assign, assign_ranges, coverage_search, least_coverage
from hetnode.planner.flowgraph import FlowResult
from hetnode.planner.heuristics import (
    HEURISTICS,
    NodeInfo,
    Range,
    Ranges,
    check_fits,
    node_infos,
    region_order,
    sp_connections,
    sp_pipelines,
)
from hetnode.planner.lns import Lns, search
from hetnode.planner.local_search import local_search
from hetnode.planner.milp import Instance, MilpSettings, PlacementMilp
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import NodePlacement, PlacementPlan
from hetnode.planner.profile import ProfileTable
from hetnode.planner.prune import all_edges, auto_degree, prune_edges
from hetnode.planner.served import served_estimate
from hetnode.planner.split import split_placement
from hetnode.planner.stages import best_stage_placement
from hetnode.planner.thunderserve.deploy import thunderserve_placement
from hetnode.planner.thunderserve.settings import ThunderServeOptions

METHODS = ("helix", "petals", "swarm", "sp", "sp+", "split", "thunderserve")
# Plans routed by their orchestration (X, Y), not by a max flow: their max_flow is 0 and validate_plan checks
# the orchestration instead.
ROUTED_METHODS = ("thunderserve",)
PICKS = ("served", "max_flow")
SMALL_CLUSTER = 8  # at most this many nodes: the §4.4 MILP is solved whole, no LNS


@dataclass(frozen=True)
class PlannerOptions:
    """Knobs of `plan_placement`; every field has a default and a bound."""

    time_limit_s: float = 60.0  # > 0: wall-clock budget of the helix search (the baselines take milliseconds)
    # >= 1 or None: rounds of the helix search's last phase (one neighbourhood and one local search each),
    # a budget of work rather than time: with it every step runs to its own deterministic limit (WORK) and
    # the plan does not depend on the machine's load, as long as time_limit_s (then a safety net) does not
    # cut in first. None: rounds until time_limit_s, each step still deterministic (a longer or quieter run
    # gets further along the same sequence of rounds).
    work_limit: int | None = None
    mip_gap: float = 0.02  # in [0, 1): stop once the best placement is within this share of the upper bound
    partial_inference: bool = True  # a node may run only the tail of its layers (Helix §4.4)
    prune_degree: int | None = None  # connections kept per node (§4.5); 0: keep all; None: auto (prune.py)
    seed: int = 0  # >= 0: seeds every randomized choice; equal seeds give equal plans unless time runs out
    warm_start: bool = True  # start the search from the best heuristic placement (§4.5)
    threads: int = 1  # >= 1: HiGHS threads
    # The plan's flows (the scheduler's weights) spread over every node that can carry flow (balance.py);
    # False keeps Edmonds-Karp's, which may leave parallel nodes idle. The max flow is the same either way.
    balance_flows: bool = True
    # How "helix" picks its plan among the search's best and the heuristics' placements: "served" (the most
    # decode tokens/s by served.served_estimate, which counts KV held for a request's lifetime on every stage)
    # or "max_flow" (Helix's objective alone). The search itself maximizes the max flow either way.
    pick: str = "served"
    # method "thunderserve": its workload, SLOs and search budget (its seed is `seed`)
    thunderserve: ThunderServeOptions = field(default_factory=ThunderServeOptions)

    def __post_init__(self) -> None:
        if not (self.time_limit_s > 0 and math.isfinite(self.time_limit_s)):
            raise ConfigError(f"time_limit_s must be a positive number of seconds, not {self.time_limit_s}")
        if not 0 <= self.mip_gap < 1:
            raise ConfigError(f"mip_gap must be in [0, 1), not {self.mip_gap}")
        if self.prune_degree is not None and self.prune_degree < 0:
            raise ConfigError(f"prune_degree must be >= 0 (0: no pruning) or None (auto), not {self.prune_degree}")
        if self.seed < 0:
            raise ConfigError(f"seed must be >= 0, not {self.seed}")
        if self.threads < 1:
            raise ConfigError(f"threads must be >= 1, not {self.threads}")
        if self.work_limit is not None and self.work_limit < 1:
            raise ConfigError(f"work_limit must be >= 1 (rounds) or None (until the time limit), not {self.work_limit}")
        if self.pick not in PICKS:
            raise ConfigError(f"pick must be one of {', '.join(PICKS)}, not {self.pick!r}")


def plan_placement(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable, *, method: str = "helix",
                   options: PlannerOptions | None = None) -> PlacementPlan:
    """Place `model`'s layers on `cluster`'s nodes. Pure: no I/O; the clock only measures and limits."""
    options = options or PlannerOptions()
    if method not in METHODS:
        raise ConfigError(f"unknown placement method {method!r}; known: {', '.join(METHODS)}")
    if method == "thunderserve":
        # Its own cost model over the cluster's GPUs (roofline, tensor parallel groups): no T_j profiles.
        return thunderserve_placement(cluster, model, dataclasses.replace(options.thunderserve, seed=options.seed))
    began = time.perf_counter()
    infos = node_infos(cluster, model, profiles)
    check_fits(cluster, model, infos)
    bound = first_bound(cluster, model, profiles, infos, options.threads)
    if method in ("sp", "sp+"):
        pipelines = sp_pipelines(cluster, model, profiles, plus=method == "sp+")
        ranges = {n: r for p in pipelines for n, r in p.items()}
        inside = sp_connections(pipelines)
        flow = evaluate(cluster, model, profiles, ranges, partial=options.partial_inference, allowed=inside)
        return _plan(cluster, model, method, ranges, flow, bound, "heuristic",
                     time.perf_counter() - began, options,
                     (f"{len(pipelines)} separate pipelines; flow kept inside each",), profiles, inside)
    if method == "split":
        return split_placement(cluster, model, profiles)
    if method != "helix":
        ranges = HEURISTICS[method](cluster, model, profiles)
        flow = evaluate(cluster, model, profiles, ranges, partial=options.partial_inference)
        return _plan(cluster, model, method, ranges, flow, bound, "heuristic",
                     time.perf_counter() - began, options, (), profiles)
    return solve_helix(cluster, model, profiles, options)


def first_bound(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable, infos: list[NodeInfo],
                threads: int = 1) -> float:
    """The bound a plan starts from: the compute bound, or the region flow bound where links make it less."""
    return min(flowgraph.upper_bound(cluster, model, profiles),
               region_flow_bound(cluster, model, infos, threads=threads))


def evaluate(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable, ranges: Mapping[str, Range], *,
             partial: bool, allowed: list[tuple[str, str]] | None = None) -> FlowResult:
    return flowgraph.evaluate(cluster, model, profiles, ranges, partial=partial, allowed=allowed)


def _plan(cluster: ClusterSpec, model: ModelSpec, method: str, ranges: Mapping[str, Range], flow: FlowResult,
          bound: float, status: str, seconds: float, options: PlannerOptions,
          notes: tuple[str, ...], profiles: ProfileTable, allowed: list[tuple[str, str]] | None = None,
          ) -> PlacementPlan:
    if options.balance_flows and flow.value > 0:
        spread = flowgraph.evaluate(cluster, model, profiles, ranges, partial=options.partial_inference,
                                    allowed=allowed, balanced=True)
        if abs(spread.value - flow.value) <= 1e-6 * flow.value:  # the same placement, the same graph
            flow = FlowResult(flow.value, spread.flows)
    order = {n.name: i for i, n in enumerate(cluster.nodes)}
    placements = tuple(NodePlacement(n, first, last)
                       for n, (first, last) in sorted(ranges.items(), key=lambda kv: order[kv[0]]))
    return PlacementPlan(cluster=cluster.name, model=model.name, num_layers=model.num_layers, method=method,
                         placements=placements, flows=dict(flow.flows), max_flow=flow.value,
                         upper_bound=max(bound, flow.value), status=status, solve_time_s=seconds,
                         partial_inference=options.partial_inference, notes=notes,
                         connections=None if allowed is None else tuple(allowed))


def complete(ranges: Mapping[str, Range], infos: list[NodeInfo], num_layers: int) -> Ranges:
    """Every node placed: one a placement leaves out takes one layer where coverage is least."""
    out = dict(ranges)
    for info in infos:
        if info.name in out:
            continue
        cov = [0.0] * num_layers
        for other in infos:
            if other.name in out:
                first, last = out[other.name]
                for layer in range(first, last):
                    cov[layer] += other.t(last - first)
        layer = min(range(num_layers), key=cov.__getitem__)
        out[info.name] = (layer, layer + 1)
    return out


@dataclass(frozen=True)
class Techniques:
    """Which parts of the helix search run (all by default); the benchmark's ablation turns them off."""

    formulation: str = "tight"  # the §4.4 model: "tight" or "paper" (milp.py)
    symmetry: bool = True  # symmetry-breaking rows in the §4.4 model
    compute_cut: bool = True  # the compute cut in the §4.4 model
    objective_cut: bool = True  # sum_i f_(source, i) <= the best upper bound, in the §4.4 model
    stages: bool = True  # stage placements (stages.py), by device class and region by region
    local_search: bool = True  # local_search.py
    coverage: bool = True  # the coverage bound and tilings (coverage.py)
    lns: bool = True  # neighbourhood search (lns.py); off: the §4.4 model gets all the time left


# Shares of the time limit: stage placements (device classes, then regions), local search (per start),
# coverage bound. The neighbourhood search and the §4.4 model get what is left. With a work limit they are
# not used: every step runs to its limit in WORK.
SHARES = {"stages": 0.1, "stages_with_regions": 0.05, "branches": 0.15, "regional": 0.4, "local": 0.08, "coverage": 0.1}
# Deterministic limits of each step (search states, branch-and-bound nodes, flow evaluations per node of the
# cluster), so that what a step returns depends on its inputs only: the clock decides how many steps run
# (without a work limit), never what one of them finds. Sized so that on one core of this project's machine
# each step usually ends on its own limit well inside its time share (a step the clock does cut short is
# the exception, and its note says so).
WORK = {"stage_states": 2_000_000, "branch_states": 1_000_000, "coverage_nodes": 50, "coverage_steps": 4,
        "local_per_node": 250, "round_local_per_node": 150, "neighbourhood_nodes": 100, "milp_nodes_per_round": 1000}


Progress = Callable[[float, int, float], None]  # (seconds, rounds of the last phase so far, best flow)


def solve_helix(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable, options: PlannerOptions,
                techniques: Techniques | None = None, progress: Progress | None = None) -> PlacementPlan:
    """plan_placement(method="helix") with a choice of techniques; `progress` hears every improvement."""
    began = time.perf_counter()
    infos = node_infos(cluster, model, profiles)
    check_fits(cluster, model, infos)
    compute_bound = flowgraph.upper_bound(cluster, model, profiles)
    return _Helix(cluster, model, profiles, infos, options, techniques or Techniques(), began,
                  compute_bound, progress=progress).run()


@dataclass
class _Helix:
    cluster: ClusterSpec
    model: ModelSpec
    profiles: ProfileTable
    infos: list[NodeInfo]
    options: PlannerOptions
    techniques: Techniques
    began: float
    compute_bound: float
    notes: list[str] = field(default_factory=list)
    progress: Progress | None = None
    rounds: int = 0  # rounds of the last phase so far

    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def left(self) -> float:
        return self.options.time_limit_s - self.elapsed()

    @property
    def by_work(self) -> bool:
        return self.options.work_limit is not None

    def share(self, part: str) -> float:
        """A phase's time: its share of the limit, or (with a work limit) all that is left, as a safety net."""
        if self.by_work:
            return max(0.0, self.left())
        return max(0.0, min(SHARES[part] * self.options.time_limit_s, self.left()))

    def step_time(self, wall: float) -> float:
        """The time one deterministic step of the last phase may take: `wall` without a work limit."""
        return max(0.0, self.left()) if self.by_work else min(self.left(), wall)

    def out_of_work(self) -> bool:
        limit = self.options.work_limit
        return limit is not None and self.rounds >= limit

    def run(self) -> PlacementPlan:
        opts, tech, cluster, model, infos = self.options, self.techniques, self.cluster, self.model, self.infos
        partial = opts.partial_inference
        layers = model.num_layers
        inst = Instance(cluster, model, infos, all_edges(infos), partial=partial, scale=self.compute_bound)
        # Pruning (§4.5) shrinks the §4.4 model, which grows with the connections; the searches' models do
        # not, and pruning their graph only takes options away (measured: placement.py's docstring).
        degree = opts.prune_degree if opts.prune_degree is not None else auto_degree(len(infos))
        kept = prune_edges(cluster, model, infos, degree or None)
        pruned = len(kept) < len(inst.node_edges)
        milp_inst = Instance(cluster, model, infos, kept, partial=partial, scale=self.compute_bound) \
            if pruned else inst

        def on_edges(ranges: Ranges) -> FlowResult:
            return evaluate(cluster, model, self.profiles, ranges, partial=partial)

        def on_kept(ranges: Ranges) -> FlowResult:
            return evaluate(cluster, model, self.profiles, ranges, partial=partial,
                            allowed=milp_inst.node_edges if pruned else None)

        # 1. heuristics: the plan's floor, and the warm start
        heuristic: tuple[str, Ranges, FlowResult] | None = None
        found: dict[str, float] = {}
        placed: dict[str, tuple[Ranges, FlowResult]] = {}
        for name, fn in HEURISTICS.items():
            try:
                ranges = fn(cluster, model, self.profiles)
            except ConfigError:
                continue
            full = evaluate(cluster, model, self.profiles, ranges, partial=partial)
            found[name] = full.value
            placed[name] = (ranges, full)
            if heuristic is None or full.value > heuristic[2].value:
                heuristic = (name, ranges, full)
        self.notes.append("heuristics: " + ", ".join(f"{k} {v:.1f}" for k, v in found.items()))
        if opts.warm_start and heuristic is not None:
            best_ranges = complete(heuristic[1], infos, layers)
        else:
            best_ranges = complete({}, infos, layers)
        best_value = on_edges(best_ranges).value
        bound = self.compute_bound
        network = region_flow_bound(cluster, model, infos, threads=opts.threads)
        if network < bound * (1 - 1e-9):
            bound = network
            self.notes.append(f"region flow bound {bound:.1f} tokens/s (compute bound {self.compute_bound:.1f})")
        gap = opts.mip_gap

        def done() -> bool:
            return best_value >= (1 - gap) * bound or self.left() <= 0.05 or self.out_of_work()

        def offer(ranges: Ranges, source: str) -> None:
            nonlocal best_ranges, best_value
            value = on_edges(ranges).value
            if value > best_value * (1 + 1e-9):
                best_ranges, best_value = ranges, value
                self.notes.append(f"{source}: {value:.1f} tokens/s at {self.elapsed():.1f} s, round {self.rounds}")
                if self.progress is not None:
                    self.progress(self.elapsed(), self.rounds, value)

        if self.progress is not None:
            self.progress(self.elapsed(), 0, best_value)

        large = len(infos) > SMALL_CLUSTER
        rank = region_order(cluster, infos)
        regions = sorted({i.region for i in infos})

        # 2. stage placements: by device class alone (coverage), then region by region (network)
        if tech.stages and large and not done():
            def on_stages(ranges: Ranges, value: float) -> None:
                if value > best_value * (1 + 1e-9):
                    for candidate in assign_ranges(ranges, infos, layers, rank):
                        offer(complete(candidate, infos, layers), "stage placement")

            low = max(best_value, least_coverage(infos, best_ranges, layers))
            best_stage_placement(infos, layers, low=low, high=bound, precision=gap / 4, on_found=on_stages,
                                 time_limit=self.share("stages" if len(regions) == 1 else "stages_with_regions"),
                                 step_limit=WORK["stage_states"])
        if tech.stages and large and len(regions) > 1 and not done():
            members: dict[str, list[str]] = {}
            for info in infos:
                members.setdefault(info.region, []).append(info.name)
            # One link between two regions: the mean over their node pairs, a missing link counting 0 (with
            # directed or pruned links the regions' "home" nodes need not be linked at all).
            between: dict[tuple[str, str], float] = {}
            for a in members:
                for b in members:
                    caps = [flowgraph.link_capacity(cluster, model, x, y) for x in members[a] for y in members[b]
                            if x != y]
                    between[(a, b)] = sum(caps) / len(caps) if caps else 0.0

            def region_links(a: str, b: str) -> float:
                return between[(a, b)]

            # Regions side by side, feeding one region's tail (branches.py): what the regional stage search,
            # which runs regions in series, cannot express (helix-geo-pruned: 6838 against its 6104-6312).
            def on_branch(found: Branches) -> None:
                if found.estimate > best_value * (1 + 1e-9):
                    offer(complete(found.ranges, infos, layers), "branch placement")

            branch_placements(infos, layers, link=region_links, partial=partial, time_limit=self.share("branches"),
                              step_limit=WORK["branch_states"], on_found=on_branch)

            def on_regional(ranges: Ranges, value: float) -> None:
                offer(complete(ranges, infos, layers), "regional stage placement")

            if not done():
                best_stage_placement(infos, layers, low=best_value, high=bound, precision=gap / 4,
                                     region_links=region_links, on_found=on_regional,
                                     time_limit=self.share("regional"), step_limit=WORK["stage_states"])

        self.notes.append(f"stage placements done at {self.elapsed():.1f} s")
        # 3. local search, from the best placement so far and from the best heuristic's
        if tech.local_search and large and not done():
            starts = [best_ranges]
            if heuristic is not None and complete(heuristic[1], infos, layers) != best_ranges:
                # The best heuristic's placement for variety, unless the stage placements left it far behind
                # (helix-geo-pruned: 2289 against 6104): then a second try from the best, with its own seed.
                far = heuristic[2].value < 0.9 * best_value
                starts.append(best_ranges if far else complete(heuristic[1], infos, layers))
            for n, start in enumerate(starts):
                ranges, _ = local_search(inst, start, seed=opts.seed + n,
                                         max_evaluations=WORK["local_per_node"] * len(infos),
                                         time_limit=self.share("local"))
                offer(ranges, "local search")

        self.notes.append(f"local search done at {self.elapsed():.1f} s")
        # 4. the coverage bound: no placement's flow reaches a level no placement covers
        if tech.coverage and large and not done():
            known = max(best_value, least_coverage(infos, best_ranges, layers))
            result = coverage_search(infos, layers, known=known, bound=bound, time_limit=self.share("coverage"),
                                     precision=gap / 4, threads=opts.threads, seed=opts.seed,
                                     node_limit=WORK["coverage_nodes"], max_steps=WORK["coverage_steps"],
                                     first=best_value / (1 - gap) if gap > 0 else None)
            if result.tiling is not None:
                for ranges in assign(result.tiling, infos, layers, rank):
                    offer(ranges, "coverage")
            if result.bound < bound:
                bound = result.bound
                self.notes.append(f"coverage bound {bound:.1f} tokens/s")

        self.notes.append(f"coverage done at {self.elapsed():.1f} s")
        # 5. until the time is up: neighbourhood search from the best placement, interleaved with local
        # search from a few different ones (the best, the heuristics'); then, for a small cluster or
        # without LNS, the §4.4 model from the best placement (where it proves optimality)
        status = "within_gap" if done() else ""
        if tech.lns and large and not done():
            lns = Lns(inst, best_ranges, evaluate=on_edges, seed=opts.seed, threads=opts.threads,
                      sub_node_limit=WORK["neighbourhood_nodes"])
            population = [best_ranges]
            if tech.local_search and heuristic is not None:
                for name in sorted(found, key=lambda k: -found[k]):
                    with contextlib.suppress(ConfigError):
                        start = complete(HEURISTICS[name](cluster, model, self.profiles), infos, layers)
                        if start not in population:
                            population.append(start)
            # Each step ends on its own node or evaluation limit; the time caps only stop one step from
            # taking the whole budget on a loaded machine (and then the round's note says so).
            cut = 0
            while not done():
                lns.step(self.step_time(max(5.0, opts.time_limit_s / 6)))
                cut += lns.log.last_status.startswith("time_limit")
                offer(lns.best, "neighbourhood search")
                if tech.local_search and not done():
                    # Every other round from the best placement (each time with a new seed: one seed's moves
                    # found helix-geo-pruned's 6104 -> 6312 in three), the others in turn from the population
                    # (the best as it was and the heuristics', for variety). With one in four from the best,
                    # a 60 s run got two tries from it.
                    k = 0 if self.rounds % 2 == 0 else (self.rounds // 2) % len(population)
                    start = best_ranges if self.rounds % 2 == 0 else population[k]
                    ranges, _ = local_search(inst, start, seed=opts.seed + 100 + self.rounds,
                                             max_evaluations=WORK["round_local_per_node"] * len(infos),
                                             time_limit=self.step_time(max(2.0, opts.time_limit_s / 20)))
                    if self.rounds % 2 == 1:
                        population[k] = ranges
                    offer(ranges, "local search")
                    lns.offer(best_ranges)
                self.rounds += 1
            log = lns.log
            self.notes.append(f"search: {log.lns_rounds} neighbourhoods ({log.lns_improvements} better, "
                              f"{log.lns_sideways} sideways), {self.rounds} rounds of local search"
                              + (f"; {cut} neighbourhoods cut short by the clock" if cut else ""))
        if not done():
            full_model = PlacementMilp(milp_inst, MilpSettings(formulation=tech.formulation,
                                                               symmetry=tech.symmetry, compute_cut=tech.compute_cut),
                                       threads=opts.threads, seed=opts.seed)
            if tech.objective_cut:
                full_model.limit_objective(bound)
            self.notes.append(f"MILP: {full_model.num_cols} variables ({full_model.num_integer} integer), "
                              f"{full_model.num_rows} constraints, {len(milp_inst.groups)} symmetry groups"
                              + (f", {len(kept)} of {len(inst.node_edges)} connections (pruned to degree "
                                 f"{degree})" if pruned else ""))
            ranges, reached, log = search(milp_inst, best_ranges, evaluate=on_kept, target=(1 - gap) * bound,
                                          time_limit=self.left(), seed=opts.seed, threads=opts.threads,
                                          full_model=full_model, lns=False, warm=opts.warm_start or best_value > 0,
                                          full_node_limit=None if opts.work_limit is None else
                                          WORK["milp_nodes_per_round"] * opts.work_limit)
            offer(ranges, "MILP")
            status = log.status
            if log.full_solves and not pruned and log.bound < bound:
                bound = log.bound
                self.notes.append(f"MILP bound {bound:.1f} tokens/s")
            self.notes.append(f"MILP: {log.status}, reached {reached.value:.1f} tokens/s")
        final = evaluate(cluster, model, self.profiles, best_ranges, partial=partial)
        bound = max(bound, final.value)
        if opts.pick == "served":
            picked = self.pick_served(best_ranges, final, placed)
            if picked is not None:
                name, ranges, flow, allowed = picked
                status = "optimal" if flow.value >= (1 - 1e-6) * bound else \
                    "within_gap" if flow.value >= (1 - gap) * bound else "heuristic"
                return _plan(cluster, model, "helix", ranges, flow, bound, status, self.elapsed(), opts,
                             tuple(self.notes), self.profiles, allowed)
        if heuristic is not None and heuristic[2].value >= final.value:
            name, ranges, flow = heuristic
            self.notes.append(f"no placement better than {name}'s found")
            status = "optimal" if flow.value >= (1 - 1e-6) * bound else \
                "within_gap" if flow.value >= (1 - gap) * bound else "heuristic"
            return _plan(cluster, model, "helix", ranges, flow, bound, status, self.elapsed(), opts,
                         tuple(self.notes), self.profiles)
        if final.value >= (1 - 1e-6) * bound:
            status = "optimal"
        elif final.value >= (1 - gap) * bound:
            status = "within_gap"
        elif status in ("", "stopped", "within_gap", "optimal"):
            status = "time_limit"
        return _plan(cluster, model, "helix", best_ranges, final, bound, status, self.elapsed(), opts,
                     tuple(self.notes), self.profiles)

    def pick_served(self, best: Ranges, flow: FlowResult, placed: Mapping[str, tuple[Ranges, FlowResult]],
                    ) -> tuple[str, Ranges, FlowResult, list[tuple[str, str]] | None] | None:
        """The heuristic placement that serves more than the search's best (served_estimate), if one does."""
        partial = self.options.partial_inference

        def serves(ranges: Ranges, allowed: list[tuple[str, str]] | None = None) -> float:
            spread = flowgraph.evaluate(self.cluster, self.model, self.profiles, ranges, partial=partial,
                                        allowed=allowed, balanced=True)
            return served_estimate(self.cluster, self.model, self.profiles, ranges, spread.flows)

        # Separate pipelines serve as separate pipelines: their flow (and the scheduler) kept inside each.
        inside: dict[str, list[tuple[str, str]]] = {}
        for name in ("sp", "sp+"):
            if name in placed:
                pipelines = sp_pipelines(self.cluster, self.model, self.profiles, plus=name == "sp+")
                inside[name] = sp_connections(pipelines)
                placed = {**placed, name: (placed[name][0], evaluate(
                    self.cluster, self.model, self.profiles, placed[name][0], partial=partial,
                    allowed=inside[name]))}
        mine = serves(best)
        scores = {name: serves(ranges, inside.get(name)) for name, (ranges, _) in placed.items()}
        self.notes.append("served estimate (decode tokens/s): search " + f"{mine:.1f}, " + ", ".join(
            f"{k} {v:.1f}" for k, v in scores.items()))
        # Ties go to the larger max flow, then to the search.
        top = max(scores, key=lambda k: (scores[k], placed[k][1].value), default=None)
        if top is None or (scores[top], placed[top][1].value) <= (mine, flow.value):
            return None
        self.notes.append(f"picked {top}'s placement: it serves more (max flow {placed[top][1].value:.1f} "
                          f"against the search's {flow.value:.1f})")
        return top, placed[top][0], placed[top][1], inside.get(top)
