"""plan_placement: every method's plan validates, helix never loses to a heuristic, limits and errors."""

from __future__ import annotations

import contextlib
import itertools
import time
from importlib.resources import files

import pytest

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec, LinkSpec, NodeSpec, load_cluster
from hetnode.planner.flowgraph import evaluate
from hetnode.planner.heuristics import HEURISTICS, node_infos
from hetnode.planner.model import ModelSpec, model_spec
from hetnode.planner.placement import (
    METHODS,
    ROUTED_METHODS,
    PlannerOptions,
    Techniques,
    complete,
    plan_placement,
    solve_helix,
)
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.profile import DeviceProfile, ProfileTable
from hetnode.planner.profile_sources import helix_profile_table
from hetnode.planner.served import served_estimate
from hetnode.planner.validate import independent_max_flow, validate_plan

CURVE = ((1.0, 1e-3),)
CLUSTERS = files("hetnode.testnet") / "clusters"


def profile(name: str, rates: list[float]) -> DeviceProfile:
    return DeviceProfile(name=name, memory_bytes=1 << 30, max_layers=len(rates), prompt_curve=CURVE,
                         decode_curve=CURVE, throughput=tuple(rates))


def fig1(layers: int = 6, per_link: float = 40.0) -> tuple[ClusterSpec, ModelSpec, ProfileTable]:
    """Helix Fig. 1a: an A100 in region 1, an L4 and three T4s in region 2, `per_link` tokens/s between."""
    nodes = (NodeSpec("a100", "a100", "r1", 40), NodeSpec("l4", "l4", "r2", 24),
             NodeSpec("t4-0", "t4", "r2", 16), NodeSpec("t4-1", "t4", "r2", 16), NodeSpec("t4-2", "t4", "r2", 16))
    cluster = ClusterSpec(name="fig1", nodes=nodes, coordinator_region="r1",
                          intra_region_link=LinkSpec(10_000, 0.1),
                          default_link=LinkSpec(per_link * 2048 * 8 / 1e6, 25))
    model = ModelSpec(f"tiny{layers}", layers, 1024, 4096, 8, 8, 1000)  # 2 KiB activations
    table = ProfileTable(model.name, {"a100": profile("a100", [300.0 / j for j in range(1, 4)]),
                                      "l4": profile("l4", [120.0 / j for j in range(1, 4)]),
                                      "t4": profile("t4", [60.0 / j for j in range(1, 4)])})
    return cluster, model, table


def paper(name: str) -> ClusterSpec:
    return load_cluster(str(CLUSTERS / f"{name}.toml"))


def brute_force(cluster: ClusterSpec, model: ModelSpec, table: ProfileTable, *, partial: bool) -> float:
    """The best max flow over every placement; the three T4s are interchangeable, so their ranges are
    enumerated as a multiset, and placements whose least coverage cannot beat the best are skipped."""
    infos = node_infos(cluster, model, table)
    L = model.num_layers
    best = 0.0

    def choices(k: int) -> list[tuple[int, int]]:
        return [(s, s + j) for j in range(1, k + 1) for s in range(L - j + 1)]

    a100, l4, t4s = infos[0], infos[1], infos[2:]
    for ra, rl, rt in itertools.product(choices(a100.max_layers), choices(l4.max_layers),
                                        itertools.combinations_with_replacement(choices(t4s[0].max_layers), 3)):
        ranges = {a100.name: ra, l4.name: rl, **{i.name: r for i, r in zip(t4s, rt, strict=True)}}
        cover = [sum(i.t(ranges[i.name][1] - ranges[i.name][0]) for i in infos
                     if ranges[i.name][0] <= layer < ranges[i.name][1]) for layer in range(L)]
        if min(cover) > best:
            best = max(best, independent_max_flow(cluster, model, table, ranges, partial=partial))
    return best


def check(plan_cluster: ClusterSpec, model: ModelSpec, table: ProfileTable, method: str,
          options: PlannerOptions) -> float:
    plan = plan_placement(plan_cluster, model, table, method=method, options=options)
    assert plan.method == method
    assert validate_plan(plan, plan_cluster, model, table) == []
    assert plan.max_flow == pytest.approx(
        independent_max_flow(plan_cluster, model, table, plan.ranges(), partial=options.partial_inference),
        rel=1e-4)
    assert plan.upper_bound >= plan.max_flow * (1 - 1e-9)
    return plan.max_flow


@pytest.mark.parametrize("partial", [True, False])
def test_every_method_validates_and_helix_is_optimal_on_a_tiny_cluster(partial: bool) -> None:
    cluster, model, table = fig1(layers=4)
    options = PlannerOptions(time_limit_s=20, mip_gap=0.0, partial_inference=partial)
    flows = {m: check(cluster, model, table, m, options) for m in METHODS if m not in ROUTED_METHODS}
    assert flows["helix"] == pytest.approx(brute_force(cluster, model, table, partial=partial), rel=1e-6)
    assert flows["helix"] >= max(flows.values()) * (1 - 1e-9)
    plan = plan_placement(cluster, model, table, options=options)
    assert plan.status == "optimal" and plan.gap <= 1e-4


def test_fig1_helix_beats_the_uniform_partition() -> None:
    cluster, model, table = fig1(layers=6)
    uniform = {"a100": (0, 2), "t4-0": (2, 4), "t4-1": (2, 4), "t4-2": (4, 6), "l4": (4, 6)}  # Fig. 1b
    fig_1d = {"a100": (0, 3), "t4-0": (0, 3), "t4-1": (0, 3), "l4": (3, 6), "t4-2": (3, 6)}
    plan = plan_placement(cluster, model, table, options=PlannerOptions(time_limit_s=20, mip_gap=0.0))
    assert plan.max_flow >= evaluate(cluster, model, table, fig_1d).value
    assert plan.max_flow >= 1.5 * evaluate(cluster, model, table, uniform).value


@pytest.mark.parametrize("name, model_name", [("helix-single", "llama-70b"), ("helix-geo", "llama-30b"),
                                              ("helix-hetero", "llama-70b")])
def test_helix_is_never_worse_than_the_best_heuristic(name: str, model_name: str) -> None:
    cluster, model = paper(name), model_spec(model_name)
    table = helix_profile_table(model)
    heuristics = []
    for method in ("petals", "swarm", "sp", "sp+"):
        with contextlib.suppress(ConfigError):
            heuristics.append(plan_placement(cluster, model, table, method=method))
    # By max flow, Helix's objective...
    by_flow = plan_placement(cluster, model, table, options=PlannerOptions(time_limit_s=3.0, pick="max_flow"))
    assert validate_plan(by_flow, cluster, model, table) == []
    assert by_flow.max_flow >= max(h.max_flow for h in heuristics) * (1 - 1e-9)
    assert by_flow.max_flow <= by_flow.upper_bound * (1 + 1e-9)
    assert by_flow.notes and by_flow.solve_time_s <= 3.0 + 1.0
    # ...and by what it serves, the default pick.
    helix = plan_placement(cluster, model, table, options=PlannerOptions(time_limit_s=3.0))
    assert validate_plan(helix, cluster, model, table) == []

    def serves(plan: PlacementPlan) -> float:
        return served_estimate(cluster, model, table, plan.ranges(), plan.flows)

    assert serves(helix) >= max(serves(h) for h in heuristics) * (1 - 1e-6)
    assert helix.max_flow <= helix.upper_bound * (1 + 1e-9)


def test_the_time_limit_is_honoured() -> None:
    cluster, model = paper("helix-hetero"), model_spec("llama-30b")
    table = helix_profile_table(model)
    began = time.perf_counter()
    plan = plan_placement(cluster, model, table, options=PlannerOptions(time_limit_s=1.5, mip_gap=0.0))
    wall = time.perf_counter() - began
    # A guard against a limit that is ignored (with a zero gap on 42 nodes the search runs for many minutes and
    # ends "optimal" or "within_gap"; stopped, it says so or that no heuristic was beaten), not a measurement of
    # how precisely it is kept, which a loaded 2-core CI machine cannot promise (2.35 s once).
    assert plan.status in ("time_limit", "heuristic"), plan.status
    assert wall < 60


def test_the_same_seed_gives_the_same_plan() -> None:
    cluster, model, table = fig1(layers=5)
    options = PlannerOptions(time_limit_s=20, mip_gap=0.0, seed=7)
    a = plan_placement(cluster, model, table, options=options)
    b = plan_placement(cluster, model, table, options=options)
    assert a.ranges() == b.ranges() and a.max_flow == b.max_flow


def test_pruning_and_cold_starts_still_give_valid_plans() -> None:
    cluster, model, table = fig1(layers=5)
    for options in (PlannerOptions(time_limit_s=10, prune_degree=2), PlannerOptions(time_limit_s=10, warm_start=False),
                    PlannerOptions(time_limit_s=10, prune_degree=0)):
        plan = plan_placement(cluster, model, table, options=options)
        assert validate_plan(plan, cluster, model, table) == []


def test_the_paper_formulation_alone_still_never_loses_to_a_heuristic() -> None:
    cluster, model, table = fig1(layers=4)
    techniques = Techniques(formulation="paper", stages=False, local_search=False, coverage=False, lns=False)
    plan = solve_helix(cluster, model, table, PlannerOptions(time_limit_s=5, mip_gap=0.0), techniques)
    assert validate_plan(plan, cluster, model, table) == []
    assert plan.max_flow == pytest.approx(brute_force(cluster, model, table, partial=True), rel=1e-6)


def test_errors() -> None:
    cluster, model, table = fig1(layers=4)
    with pytest.raises(ConfigError, match="unknown placement method 'gurobi'"):
        plan_placement(cluster, model, table, method="gurobi")
    small = ProfileTable(model.name, {d: profile(d, [10.0]) for d in ("a100", "l4", "t4")})
    big = ModelSpec("tiny9", 9, 1024, 4096, 8, 8, 1000)
    with pytest.raises(ConfigError, match=r"hold 5 layers .* has 9"):
        plan_placement(cluster, big, small)
    for bad in ({"time_limit_s": 0}, {"mip_gap": 1.0}, {"prune_degree": -1}, {"seed": -1}, {"threads": 0}):
        with pytest.raises(ConfigError):
            PlannerOptions(**bad)  # type: ignore[arg-type]


def test_complete_places_every_node() -> None:
    cluster, model, table = fig1(layers=4)
    infos = node_infos(cluster, model, table)
    ranges = complete({"a100": (0, 3), "l4": (3, 4)}, infos, 4)
    assert set(ranges) == {i.name for i in infos}
    assert evaluate(cluster, model, table, ranges).value >= evaluate(
        cluster, model, table, {"a100": (0, 3), "l4": (3, 4)}).value
    assert set(HEURISTICS) <= set(METHODS)
