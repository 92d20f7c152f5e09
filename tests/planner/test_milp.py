"""The §4.4 MILP, the neighbourhood MILP, and the bounds: checked against brute force on tiny clusters."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from hetnode.planner.cluster import ClusterSpec, LinkSpec, NodeSpec
from hetnode.planner.coverage import coverage_search, feasible_tiling, least_coverage
from hetnode.planner.flowgraph import evaluate, upper_bound
from hetnode.planner.heuristics import node_infos
from hetnode.planner.lns import NeighbourhoodMilp, min_cut_nodes, search
from hetnode.planner.local_search import FastFlow, local_search
from hetnode.planner.milp import Instance, MilpSettings, PlacementMilp, symmetry_groups
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import SINK, SOURCE
from hetnode.planner.profile import DeviceProfile, ProfileTable
from hetnode.planner.prune import all_edges, prune_edges
from hetnode.planner.stages import stage_placement
from hetnode.planner.validate import independent_max_flow

CURVE = ((1.0, 1e-3),)


def profile(name: str, rates: list[float]) -> DeviceProfile:
    return DeviceProfile(name=name, memory_bytes=1 << 30, max_layers=len(rates), prompt_curve=CURVE,
                         decode_curve=CURVE, throughput=tuple(rates))


def tiny_model(layers: int) -> ModelSpec:
    # hidden 1024, fp16: a 2 KiB activation, so 1 Mb/s carries about 61 tokens/s between nodes
    return ModelSpec(f"tiny{layers}", layers, 1024, 4096, 8, 8, 1000)


def fig1(layers: int = 4, slow_mbps: float = 1.0, small_k: int = 2) -> tuple[ClusterSpec, ModelSpec, ProfileTable]:
    """Helix Fig. 1a: an A100 in region 1; an L4 and three T4s in region 2; a slow link between them.

    Compute capacity A100 > L4 > T4 (300, 120, 60 layer-tokens/s); the A100 holds 3 layers, the others
    `small_k`."""
    nodes = (NodeSpec("a100", "a100", "r1", 40), NodeSpec("l4", "l4", "r2", 24),
             NodeSpec("t4-0", "t4", "r2", 16), NodeSpec("t4-1", "t4", "r2", 16), NodeSpec("t4-2", "t4", "r2", 16))
    cluster = ClusterSpec(name="fig1", nodes=nodes, coordinator_region="r1",
                          intra_region_link=LinkSpec(10_000, 0.1), default_link=LinkSpec(slow_mbps, 25))
    model = tiny_model(layers)
    table = ProfileTable(model.name, {"a100": profile("a100", [300.0 / j for j in range(1, 4)]),
                                      "l4": profile("l4", [120.0 / j for j in range(1, small_k + 1)]),
                                      "t4": profile("t4", [60.0 / j for j in range(1, small_k + 1)])})
    return cluster, model, table


def two_types(layers: int = 5) -> tuple[ClusterSpec, ModelSpec, ProfileTable]:
    nodes = (NodeSpec("a", "a100", "r", 40), NodeSpec("b", "t4", "r", 16), NodeSpec("c", "t4", "r", 16))
    cluster = ClusterSpec(name="three", nodes=nodes, coordinator_region="r", default_link=LinkSpec(10_000, 0.1))
    model = tiny_model(layers)
    table = ProfileTable(model.name, {"a100": profile("a100", [100.0, 52.0, 30.0, 21.0]),
                                      "t4": profile("t4", [40.0, 19.0, 11.0])})
    return cluster, model, table


def options(max_layers: int, layers: int) -> list[tuple[int, int]]:
    return [(s, s + j) for j in range(1, max_layers + 1) for s in range(layers - j + 1)]


def brute_force(cluster: ClusterSpec, model: ModelSpec, table: ProfileTable, *, partial: bool,
                allowed: list[tuple[str, str]] | None = None) -> float:
    """The best max flow over every placement of every node (each node holds at least one layer)."""
    infos = node_infos(cluster, model, table)
    best = 0.0
    for combo in itertools.product(*(options(i.max_layers, model.num_layers) for i in infos)):
        ranges = {i.name: r for i, r in zip(infos, combo, strict=True)}
        if least_coverage(infos, ranges, model.num_layers) <= best:
            continue  # coverage bounds the flow
        best = max(best, independent_max_flow(cluster, model, table, ranges, partial=partial, allowed=allowed))
    return best


def instance(cluster: ClusterSpec, model: ModelSpec, table: ProfileTable, *, partial: bool,
             edges: list[tuple[str, str]] | None = None) -> Instance:
    infos = node_infos(cluster, model, table)
    return Instance(cluster, model, infos, edges if edges is not None else all_edges(infos), partial=partial,
                    scale=upper_bound(cluster, model, table))


CASES = {"fig1": fig1, "two-types": two_types}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("partial", [True, False])
@pytest.mark.parametrize("formulation", ["tight", "paper"])
def test_milp_matches_brute_force(case: str, partial: bool, formulation: str) -> None:
    cluster, model, table = CASES[case]()
    optimum = brute_force(cluster, model, table, partial=partial)
    inst = instance(cluster, model, table, partial=partial)
    milp = PlacementMilp(inst, MilpSettings(formulation=formulation))
    result, ranges = milp.solve(time_limit=20, mip_gap=1e-7)
    assert result.status == "optimal"
    assert ranges is not None
    flow = evaluate(cluster, model, table, ranges, partial=partial).value
    assert flow == pytest.approx(optimum, rel=1e-6)
    assert result.objective == pytest.approx(optimum, rel=1e-5)
    assert result.bound == pytest.approx(optimum, rel=1e-4)


def test_fig1_uniform_partition_is_bottlenecked_and_the_milp_does_better() -> None:
    """Fig. 1b: three even stages, devices balanced per stage: the two T4s of the middle stage bottleneck
    it. Fig. 1d: the A100 and two T4s in parallel on the first half, the L4 and a T4 on the second, so
    that less traffic crosses the slow link. The MILP finds at least as much as either."""
    cluster, model, table = fig1(layers=6, slow_mbps=40 * 2048 * 8 / 1e6, small_k=3)  # 40 tokens/s per link
    uniform = {"a100": (0, 2), "t4-0": (2, 4), "t4-1": (2, 4), "t4-2": (4, 6), "l4": (4, 6)}
    flow_b = evaluate(cluster, model, table, uniform).value
    assert flow_b == pytest.approx(2 * 30.0)  # the middle stage: two T4s holding 2 layers each
    fig_1d = {"a100": (0, 3), "t4-0": (0, 3), "t4-1": (0, 3), "l4": (3, 6), "t4-2": (3, 6)}
    flow_d = evaluate(cluster, model, table, fig_1d).value
    inst = instance(cluster, model, table, partial=True)
    result, ranges = PlacementMilp(inst).solve(time_limit=20, mip_gap=1e-7)
    assert result.status == "optimal" and ranges is not None
    best = evaluate(cluster, model, table, ranges).value
    assert best >= max(flow_b, flow_d)
    assert best > 1.2 * flow_b


def test_warm_start_is_taken_as_the_incumbent() -> None:
    cluster, model, table = two_types()
    inst = instance(cluster, model, table, partial=True)
    milp = PlacementMilp(inst)
    ranges = inst.canonical({"a": (0, 3), "b": (3, 5), "c": (3, 5)})
    flow = evaluate(cluster, model, table, ranges)
    result, found = milp.solve(time_limit=5, start=milp.solution_of(ranges, flow.flows), node_limit=0)
    assert found is not None
    assert result.objective >= flow.value * (1 - 1e-6)


def test_warm_starts_must_be_canonical() -> None:
    cluster, model, table = two_types()
    inst = instance(cluster, model, table, partial=True)
    assert inst.groups == [[1, 2]]  # the two T4s
    milp = PlacementMilp(inst)
    ranges = {"a": (0, 3), "b": (3, 5), "c": (0, 1)}
    with pytest.raises(ValueError, match="canonical"):
        milp.solution_of(ranges, evaluate(cluster, model, table, ranges).flows)


def test_symmetry_groups_need_equal_links_too() -> None:
    cluster, model, table = fig1()
    inst = instance(cluster, model, table, partial=True)
    assert [[inst.names[i] for i in g] for g in inst.groups] == [["t4-0", "t4-1", "t4-2"]]
    # Drop one T4's link to the L4: it is no longer interchangeable with the others.
    edges = [e for e in all_edges(inst.infos) if e not in {("t4-0", "l4"), ("l4", "t4-0")}]
    groups = symmetry_groups(inst.infos, instance(cluster, model, table, partial=True, edges=edges).cap)
    assert [[inst.names[i] for i in g] for g in groups] == [["t4-1", "t4-2"]]


def test_the_paper_formulation_is_weak_and_the_tight_one_is_not() -> None:
    cluster, model, table = fig1()
    inst = instance(cluster, model, table, partial=True)
    optimum = brute_force(cluster, model, table, partial=True)
    root = {f: PlacementMilp(inst, MilpSettings(formulation=f)).relaxation_bound() for f in ("paper", "tight")}
    assert optimum * (1 - 1e-6) <= root["tight"] <= upper_bound(cluster, model, table) * (1 + 1e-6)
    assert root["paper"] > 2 * root["tight"]


@pytest.mark.parametrize("partial", [True, False])
def test_neighbourhood_milp_with_every_node_free_is_exact(partial: bool) -> None:
    cluster, model, table = fig1()
    inst = instance(cluster, model, table, partial=partial)
    start = inst.canonical({"a100": (0, 3), "l4": (3, 4), "t4-0": (3, 4), "t4-1": (3, 4), "t4-2": (3, 4)})
    flow = evaluate(cluster, model, table, start, partial=partial)
    sub = NeighbourhoodMilp(inst, start, inst.names)
    _result, ranges = sub.solve(sub.solution_of(start, flow.flows), time_limit=20, node_limit=None, mip_gap=1e-7)
    assert ranges is not None
    assert evaluate(cluster, model, table, ranges, partial=partial).value == pytest.approx(
        brute_force(cluster, model, table, partial=partial), rel=1e-6)


def test_neighbourhood_milp_keeps_fixed_nodes_and_optimizes_the_rest() -> None:
    cluster, model, table = two_types(layers=4)
    inst = instance(cluster, model, table, partial=True)
    start = {"a": (0, 2), "b": (2, 3), "c": (3, 4)}
    flow = evaluate(cluster, model, table, start)
    sub = NeighbourhoodMilp(inst, start, ["b", "c"])
    _, ranges = sub.solve(sub.solution_of(start, flow.flows), time_limit=20, node_limit=None, mip_gap=1e-7)
    assert ranges is not None and ranges["a"] == (0, 2)
    best = max(independent_max_flow(cluster, model, table, {"a": (0, 2), "b": rb, "c": rc})
               for rb in options(3, 4) for rc in options(3, 4))
    assert evaluate(cluster, model, table, ranges).value == pytest.approx(best, rel=1e-6)


def test_search_reaches_the_optimum_and_the_full_model_proves_it() -> None:
    cluster, model, table = fig1()
    inst = instance(cluster, model, table, partial=True)
    start = inst.canonical({"a100": (0, 2), "l4": (2, 4), "t4-0": (2, 4), "t4-1": (0, 2), "t4-2": (0, 1)})

    def on_edges(r: dict[str, tuple[int, int]]):  # type: ignore[no-untyped-def]
        return evaluate(cluster, model, table, r)

    _ranges, flow, log = search(inst, start, evaluate=on_edges, target=math.inf, time_limit=8, seed=1,
                               full_model=PlacementMilp(inst))
    assert flow.value == pytest.approx(brute_force(cluster, model, table, partial=True), rel=1e-6)
    assert log.full_solves == 1 and log.status == "optimal"
    assert log.bound == pytest.approx(flow.value, rel=1e-4)


def test_min_cut_nodes_name_the_bottleneck() -> None:
    cluster, model, table = two_types(layers=4)
    inst = instance(cluster, model, table, partial=True)
    ranges = {"a": (0, 2), "c": (0, 2), "b": (2, 4)}  # b, alone on layers 2 and 3, is the bottleneck
    flow = evaluate(cluster, model, table, ranges)
    assert flow.value == pytest.approx(19.0)
    assert min_cut_nodes(inst, ranges, flow) == ["b"]


def test_coverage_bounds_every_flow_and_equals_it_on_fast_links() -> None:
    cluster, model, table = two_types()
    infos = node_infos(cluster, model, table)
    optimum = brute_force(cluster, model, table, partial=True)
    result = coverage_search(infos, model.num_layers, known=0.0, bound=upper_bound(cluster, model, table),
                             time_limit=10, precision=1e-4)
    assert result.bound >= optimum * (1 - 1e-9)
    assert result.value == pytest.approx(optimum, rel=2e-4)  # partial inference, fast links: flow = coverage
    assert feasible_tiling(infos, model.num_layers, optimum * 1.01, time_limit=5)[0] == "infeasible"


def test_stage_placements_and_their_bound() -> None:
    cluster, model, table = two_types(layers=4)
    infos = node_infos(cluster, model, table)
    outcome, ranges = stage_placement(infos, model.num_layers, 40.0, deadline=math.inf)
    assert outcome == "feasible" and ranges is not None
    assert least_coverage(infos, ranges, model.num_layers) >= 40.0
    assert stage_placement(infos, model.num_layers, 500.0, deadline=math.inf)[0] == "infeasible"


def test_regional_stage_placements_respect_slow_links() -> None:
    cluster, model, table = fig1(layers=4, slow_mbps=1.0)  # ~61 tokens/s per cross link
    infos = node_infos(cluster, model, table)
    links = {("r1", "r2"): 61.0, ("r2", "r1"): 61.0}
    outcome, ranges = stage_placement(infos, model.num_layers, 100.0, deadline=math.inf,
                                      region_links=lambda a, b: links.get((a, b), math.inf))
    assert outcome == "feasible" and ranges is not None
    # The A100 alone cannot hold 4 layers, so a stage boundary crosses regions: it needs >= 2 links.
    assert evaluate(cluster, model, table, ranges).value >= 100.0 * (1 - 1e-9) or \
        least_coverage(infos, ranges, model.num_layers) >= 100.0


def test_local_search_never_loses_flow_and_fast_flow_agrees() -> None:
    cluster, model, table = fig1(layers=5)
    inst = instance(cluster, model, table, partial=True)
    start = {"a100": (0, 1), "l4": (1, 3), "t4-0": (3, 5), "t4-1": (3, 4), "t4-2": (4, 5)}
    fast = FastFlow(inst)
    s, e = fast.arrays(start)
    assert fast.flow(s, e) * inst.scale == pytest.approx(evaluate(cluster, model, table, start).value, rel=1e-4)
    ranges, value = local_search(inst, start, seed=3, max_evaluations=3000, time_limit=5)
    assert evaluate(cluster, model, table, ranges).value == pytest.approx(value, rel=1e-4)
    assert value >= evaluate(cluster, model, table, start).value


def test_pruning_keeps_the_fastest_links_and_the_coordinator() -> None:
    cluster, model, table = fig1()
    infos = node_infos(cluster, model, table)
    kept = prune_edges(cluster, model, infos, degree=2)
    # Region 2's nodes keep two fast links each; only the A100's own two choices cross the slow link.
    assert len({frozenset(e) for e in kept if "a100" in e}) == 2
    assert all(sum(1 for a, _ in kept if a == i.name) >= 2 for i in infos)
    assert set(kept) == {(b, a) for a, b in kept}  # both ways
    assert prune_edges(cluster, model, infos, degree=None) == all_edges(infos)
    inst = instance(cluster, model, table, partial=True, edges=kept)
    assert all((SOURCE, n) in inst.cap and (n, SINK) in inst.cap for n in inst.names)


def test_instance_capacities_are_tight() -> None:
    cluster, model, table = fig1(slow_mbps=1.0)
    inst = instance(cluster, model, table, partial=True)
    # the slow link: 1 Mb/s over 2 KiB activations; the source edges: the node's own T_1
    assert inst.cap[("a100", "l4")] * inst.scale == pytest.approx(1e6 / 8 / 2048)
    assert inst.cap[(SOURCE, "t4-0")] * inst.scale == pytest.approx(60.0)
    assert np.isfinite(list(inst.raw_cap.values())).all()
