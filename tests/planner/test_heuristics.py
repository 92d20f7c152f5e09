"""Helix §6's baselines: Petals, Swarm, separate pipelines (sp, sp+)."""

from __future__ import annotations

import itertools
import math
from importlib.resources import files

import pytest

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec, LinkSpec, NodeSpec, load_cluster
from hetnode.planner.flowgraph import evaluate
from hetnode.planner.heuristics import (
    HEURISTICS,
    balanced_split,
    node_infos,
    petals_ranges,
    sp_pipelines,
    sp_ranges,
    swarm_ranges,
    swarm_stage_sizes,
)
from hetnode.planner.model import ModelSpec, model_spec
from hetnode.planner.placement import plan_placement
from hetnode.planner.plan import NodePlacement, PlacementPlan
from hetnode.planner.profile import DeviceProfile, ProfileTable
from hetnode.planner.profile_sources import helix_profile_table
from hetnode.planner.validate import independent_max_flow, validate_plan

CURVE = ((1.0, 1e-3),)
CLUSTERS = files("hetnode.testnet") / "clusters"


def profile(name: str, rates: list[float]) -> DeviceProfile:
    return DeviceProfile(name=name, memory_bytes=1 << 30, max_layers=len(rates), prompt_curve=CURVE,
                         decode_curve=CURVE, throughput=tuple(rates))


def flat(total: float, k: int) -> list[float]:
    return [total / j for j in range(1, k + 1)]


def cluster_of(devices: list[tuple[str, str, str]], *, link: LinkSpec = LinkSpec(10_000, 0.1)) -> ClusterSpec:
    nodes = tuple(NodeSpec(name, device, region, 16) for name, device, region in devices)
    return ClusterSpec(name="t", nodes=nodes, coordinator_region=nodes[0].region, default_link=link)


def paper(name: str) -> ClusterSpec:
    return load_cluster(str(CLUSTERS / f"{name}.toml"))


def plan_of(cluster: ClusterSpec, model: ModelSpec, table: ProfileTable, ranges: dict[str, tuple[int, int]],
            method: str) -> PlacementPlan:
    flow = evaluate(cluster, model, table, ranges)
    return PlacementPlan(cluster=cluster.name, model=model.name, num_layers=model.num_layers, method=method,
                         placements=tuple(NodePlacement(n, *r) for n, r in ranges.items()), flows=flow.flows,
                         max_flow=flow.value)


MODEL8 = ModelSpec("m8", 8, 1024, 4096, 8, 8, 1000)


def test_petals_takes_the_least_served_block_in_join_order() -> None:
    cluster = cluster_of([("a", "a100", "r"), ("b", "l4", "r"), ("c", "t4", "r"), ("d", "t4", "r")])
    table = ProfileTable("m8", {"a100": profile("a100", flat(60, 4)), "l4": profile("l4", flat(30, 3)),
                                "t4": profile("t4", flat(10, 3))})
    ranges = petals_ranges(cluster, MODEL8, table)
    # a: [0, 4) at 15; b: the first block without any server, [4, 7) at 10; c: [5, 8), the only block with an
    # uncovered layer; d: the block whose sorted throughputs are least, [5, 8) again (3.3 on layer 7).
    assert ranges["a"] == (0, 4) and ranges["b"] == (4, 7) and ranges["c"] == (5, 8)
    assert ranges["d"] == (5, 8)
    # Fastest first, then a seeded shuffle: different orders, the same rule.
    assert petals_ranges(cluster, MODEL8, table, order="capacity")["a"] == (0, 4)
    assert petals_ranges(cluster, MODEL8, table, order="random", seed=5) == \
        petals_ranges(cluster, MODEL8, table, order="random", seed=5)
    with pytest.raises(ConfigError, match="order"):
        petals_ranges(cluster, MODEL8, table, order="alphabetical")


def test_swarm_uses_the_fewest_stages_the_weakest_node_allows() -> None:
    model = model_spec("llama-70b")
    table = helix_profile_table(model)  # t4 holds 4 layers of LLaMA-70B with half its memory for KV
    cluster = paper("helix-single")
    infos = node_infos(cluster, model, table)
    assert swarm_stage_sizes(infos, 80) == [4] * 20
    ranges = swarm_ranges(cluster, model, table)
    assert sorted({r for r in ranges.values()}) == [(4 * s, 4 * s + 4) for s in range(20)]
    # Nodes go fastest first to the stage with the least throughput: the 4 A100s get stages of their own.
    a100_stages = {ranges[n.name] for n in cluster.nodes if n.device == "a100"}
    assert len(a100_stages) == 4
    assert all(sum(1 for r in ranges.values() if r == s) == 1 for s in a100_stages)


def test_swarm_stages_are_even_and_balanced() -> None:
    assert swarm_stage_sizes(node_infos(*_three_types()), 10) == [4, 3, 3]
    cluster, model, table = _three_types()
    ranges = swarm_ranges(cluster, model, table)
    per_stage: dict[tuple[int, int], float] = {}
    for n, (first, last) in ranges.items():
        per_stage[(first, last)] = per_stage.get((first, last), 0.0) + \
            table.for_node(n, cluster.node(n).device).tokens_per_s(last - first)
    biggest = max(table.profiles[d].tokens_per_s(3) for d in table.profiles)
    assert max(per_stage.values()) - min(per_stage.values()) <= biggest


def _three_types() -> tuple[ClusterSpec, ModelSpec, ProfileTable]:
    cluster = cluster_of([("a0", "a100", "r"), ("a1", "a100", "r"), ("l0", "l4", "r"), ("l1", "l4", "r"),
                          ("t0", "t4", "r"), ("t1", "t4", "r"), ("t2", "t4", "r")])
    model = ModelSpec("m10", 10, 1024, 4096, 8, 8, 1000)
    table = ProfileTable("m10", {"a100": profile("a100", flat(90, 10)), "l4": profile("l4", flat(40, 6)),
                                 "t4": profile("t4", flat(20, 4))})
    return cluster, model, table


def test_separate_pipelines_leave_out_types_that_cannot_hold_the_model() -> None:
    cluster, model, table = _three_types()
    ranges = sp_ranges(cluster, model, table)
    # a100 (2 x 10 layers) and l4 (2 x 6) hold 10 layers alone; t4 (3 x 4 = 12) does too.
    assert set(ranges) == {n.name for n in cluster.nodes}
    for device in ("a100", "l4", "t4"):
        members = [n.name for n in cluster.nodes if n.device == device]
        spans = sorted(ranges[m] for m in members)
        assert spans[0][0] == 0 and spans[-1][1] == 10
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))  # one pipeline, no overlap


def test_sp_plus_builds_a_mixed_pipeline_from_the_leftovers() -> None:
    cluster = cluster_of([("a", "a100", "r"), ("l", "l4", "r"), ("t0", "t4", "r"), ("t1", "t4", "r")])
    table = ProfileTable("m8", {"a100": profile("a100", flat(60, 8)), "l4": profile("l4", flat(30, 3)),
                                "t4": profile("t4", flat(10, 3))})
    assert set(sp_ranges(cluster, MODEL8, table)) == {"a"}  # l4 (3) and t4 (2 x 3) cannot hold 8 layers
    plus = sp_ranges(cluster, MODEL8, table, plus=True)
    assert set(plus) == {"a", "l", "t0", "t1"}
    mixed = sorted((plus[n], n) for n in ("l", "t0", "t1"))
    assert mixed[0][0][0] == 0 and mixed[-1][0][1] == 8
    with pytest.raises(ConfigError, match="no device type"):
        sp_ranges(cluster_of([("l", "l4", "r"), ("t0", "t4", "r"), ("t1", "t4", "r")]), MODEL8, table)


def test_balanced_split_maximizes_the_slowest_stage() -> None:
    cluster, model, table = _three_types()
    infos = node_infos(cluster, model, table)[1:5]  # an a100, two l4s, a t4
    counts = balanced_split(infos, 10)
    assert counts is not None and sum(counts) == 10
    best = max(min(i.t(j) for i, j in zip(infos, c, strict=True))
               for c in itertools.product(*(range(1, i.max_layers + 1) for i in infos)) if sum(c) == 10)
    assert min(i.t(j) for i, j in zip(infos, counts, strict=True)) == pytest.approx(best)
    assert balanced_split(infos[:1], 11) is None  # cannot hold it


@pytest.mark.parametrize("name", ["helix-single", "helix-geo", "helix-hetero"])
@pytest.mark.parametrize("model_name", ["llama-30b", "llama-70b"])
def test_paper_cluster_heuristic_plans_validate(name: str, model_name: str) -> None:
    cluster, model = paper(name), model_spec(model_name)
    table = helix_profile_table(model)
    for method, fn in HEURISTICS.items():
        try:
            ranges = fn(cluster, model, table)
        except ConfigError as exc:
            assert method == "sp" and "no device type" in str(exc)
            continue
        if method in ("sp", "sp+"):
            # Separate pipelines keep their flow inside each pipeline: at most the flow over every connection.
            plan = plan_placement(cluster, model, table, method=method)
            assert plan.ranges() == ranges
            assert validate_plan(plan, cluster, model, table) == [], method
            assert 0 < plan.max_flow <= independent_max_flow(cluster, model, table, ranges) * (1 + 1e-6)
            continue
        plan = plan_of(cluster, model, table, ranges, method)
        assert validate_plan(plan, cluster, model, table) == [], method
        assert plan.max_flow == pytest.approx(independent_max_flow(cluster, model, table, ranges), rel=1e-4)


def test_separate_pipelines_keep_each_request_inside_one_pipeline() -> None:
    cluster, model = paper("helix-geo"), model_spec("llama-30b")
    table = helix_profile_table(model)
    pipelines = sp_pipelines(cluster, model, table)
    assert len(pipelines) >= 2
    member = {n: i for i, p in enumerate(pipelines) for n in p}
    plan = plan_placement(cluster, model, table, method="sp")
    used = [(a, b) for (a, b), f in plan.flows.items() if f > 1e-9 and a in member and b in member]
    assert used and all(member[a] == member[b] for a, b in used)
    # Over every connection the same ranges would carry more: the replicas meet where their ranges do.
    assert plan.max_flow < independent_max_flow(cluster, model, table, plan.ranges())


def test_a_cluster_that_cannot_hold_the_model() -> None:
    cluster = cluster_of([("t0", "t4", "r"), ("t1", "t4", "r")])
    table = ProfileTable("m8", {"t4": profile("t4", flat(10, 3))})
    for fn in HEURISTICS.values():
        with pytest.raises(ConfigError, match=r"holds? 6 layers .* has 8"):
            fn(cluster, MODEL8, table)


def test_swarm_needs_a_node_per_stage() -> None:
    cluster = cluster_of([("a", "a100", "r"), ("t", "t4", "r")])
    table = ProfileTable("m8", {"a100": profile("a100", flat(60, 8)), "t4": profile("t4", flat(10, 1))})
    with pytest.raises(ConfigError, match="8 stages"):
        swarm_ranges(cluster, MODEL8, table)
    assert math.isfinite(evaluate(cluster, MODEL8, table, petals_ranges(cluster, MODEL8, table)).value)
