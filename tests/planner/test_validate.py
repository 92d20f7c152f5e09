from __future__ import annotations

import random
from dataclasses import replace

import pytest

from hetnode.planner.cluster import ClusterSpec, LinkSpec, NodeSpec
from hetnode.planner.devices import parse_device
from hetnode.planner.flowgraph import evaluate, link_capacity, valid_edges
from hetnode.planner.model import model_spec
from hetnode.planner.plan import SINK, SOURCE, NodePlacement, PlacementPlan
from hetnode.planner.profile import ProfileTable
from hetnode.planner.profile_sources import helix_profile_table, roofline_profile_table
from hetnode.planner.validate import independent_max_flow, validate_plan

MODEL = model_spec("llama-30b")  # 60 layers
PROFILES = helix_profile_table(MODEL)  # a100 18, l4 11, t4 7 layers at most


def cluster(link: LinkSpec | None = LinkSpec(10_000, 1)) -> ClusterSpec:
    nodes = (NodeSpec("a", "a100", "us", 40), NodeSpec("b", "a100", "us", 40), NodeSpec("c", "a100", "us", 40),
             NodeSpec("d", "a100", "us", 40), NodeSpec("l", "l4", "eu", 24), NodeSpec("t", "t4", "eu", 16))
    return ClusterSpec(name="six", nodes=nodes, coordinator_region="us", default_link=link)


CLUSTER = cluster()
RANGES = {"a": (0, 18), "b": (15, 33), "c": (30, 48), "d": (42, 60), "l": (0, 11), "t": (11, 18)}


def plan_of(ranges: dict[str, tuple[int, int]], *, partial: bool = True, cl: ClusterSpec = CLUSTER,
            profiles: ProfileTable = PROFILES) -> PlacementPlan:
    result = evaluate(cl, MODEL, profiles, ranges, partial=partial)
    return PlacementPlan(cluster=cl.name, model=MODEL.name, num_layers=MODEL.num_layers, method="given",
                         placements=tuple(NodePlacement(n, *r) for n, r in ranges.items()), flows=result.flows,
                         max_flow=result.value, partial_inference=partial)


def only(problems: list[str], text: str) -> None:
    assert problems, "expected a problem"
    assert any(text in p for p in problems), problems


def test_a_max_flow_plan_is_valid() -> None:
    plan = plan_of(RANGES)
    assert plan.max_flow > 0
    assert validate_plan(plan, CLUSTER, MODEL, PROFILES) == []
    strict = plan_of(RANGES, partial=False)
    assert validate_plan(strict, CLUSTER, MODEL, PROFILES) == []
    assert strict.max_flow < plan.max_flow  # b, c, d need partial inference to be reached


def test_unknown_and_duplicate_nodes() -> None:
    plan = plan_of(RANGES)
    ghost = replace(plan, placements=(*plan.placements, NodePlacement("ghost", 0, 60)))
    only(validate_plan(ghost, CLUSTER, MODEL, PROFILES), "'ghost' is not in cluster six")
    twice = replace(plan, placements=(*plan.placements, NodePlacement("a", 0, 18)))
    only(validate_plan(twice, CLUSTER, MODEL, PROFILES), "'a' is placed twice")
    flows = {**plan.flows, ("a", "ghost"): 1.0}
    only(validate_plan(replace(plan, flows=flows), CLUSTER, MODEL, PROFILES), "'ghost' is not in the cluster")


def test_layer_ranges() -> None:
    plan = plan_of(RANGES)
    bad = replace(plan, placements=(*plan.placements[:-1], NodePlacement("t", 55, 65)))
    only(validate_plan(bad, CLUSTER, MODEL, PROFILES), "layers [55, 65) are not within [0, 60)")
    too_many = replace(plan, placements=(*plan.placements[:-1], NodePlacement("t", 11, 19)))
    only(validate_plan(too_many, CLUSTER, MODEL, PROFILES), "holds 8 layers, more than its max_layers 7")
    wrong_model = replace(plan, num_layers=80)
    only(validate_plan(wrong_model, CLUSTER, MODEL, PROFILES), "the plan is for 80 layers")


def test_every_layer_must_be_held() -> None:
    ranges = {"a": (0, 18), "b": (20, 38), "c": (38, 50), "d": (52, 60)}
    problems = validate_plan(plan_of(ranges), CLUSTER, MODEL, PROFILES)
    only(problems, "layers [18, 20), [50, 52) are held by no node")


def test_flows_only_on_valid_edges() -> None:
    plan = plan_of(RANGES)
    # l [0, 11) -> c [30, 48) skips layers.
    only(validate_plan(replace(plan, flows={**plan.flows, ("l", "c"): 5.0}), CLUSTER, MODEL, PROFILES),
         "edge l -> c: carries 5 tokens/s but is not a valid connection (l [0, 11) to c [30, 48))")
    # t does not hold the last layer.
    only(validate_plan(replace(plan, flows={**plan.flows, ("t", SINK): 1.0}), CLUSTER, MODEL, PROFILES),
         "edge t -> sink")
    only(validate_plan(replace(plan, flows={**plan.flows, (SOURCE, SINK): 1.0}), CLUSTER, MODEL, PROFILES),
         "edge source -> sink")
    # a [0, 18) -> b [15, 33) needs partial inference.
    assert ("a", "b") in plan.flows
    only(validate_plan(replace(plan, partial_inference=False), CLUSTER, MODEL, PROFILES), "edge a -> b")
    only(validate_plan(replace(plan, flows={**plan.flows, ("a", "b"): -1.0}), CLUSTER, MODEL, PROFILES),
         "not a finite non-negative number")


def test_conservation_and_source_sink_balance() -> None:
    plan = plan_of(RANGES)
    edge = next(e for e in plan.flows if e[0] == "a")
    flows = {**plan.flows, edge: plan.flows[edge] + 100.0}
    problems = validate_plan(replace(plan, flows=flows), CLUSTER, MODEL, PROFILES)
    only(problems, "node a: flow is not conserved")


def test_node_and_link_capacities() -> None:
    plan = plan_of(RANGES)
    doubled = replace(plan, flows={e: 2 * f for e, f in plan.flows.items()}, max_flow=2 * plan.max_flow)
    problems = validate_plan(doubled, CLUSTER, MODEL, PROFILES)
    only(problems, "over its throughput T_18")
    slow = cluster(LinkSpec(10, 1))  # 10 Mb/s: 76 activations per second between nodes
    problems = validate_plan(plan, slow, MODEL, PROFILES)
    cap = link_capacity(slow, MODEL, "a", "b")
    only(problems, f"over the link capacity {cap:.6g} tokens/s")
    only(problems, "differs from the max flow of the placement's graph")


def test_max_flow_must_match_source_and_the_independent_max_flow() -> None:
    plan = plan_of(RANGES)
    only(validate_plan(replace(plan, max_flow=plan.max_flow + 50), CLUSTER, MODEL, PROFILES),
         "is not the flow out of the source")
    # A consistent but smaller flow is feasible, yet not the max flow of its placement.
    half = replace(plan, flows={e: f / 2 for e, f in plan.flows.items()}, max_flow=plan.max_flow / 2)
    problems = validate_plan(half, CLUSTER, MODEL, PROFILES)
    assert len(problems) == 1
    only(problems, "differs from the max flow of the placement's graph")
    # Within 0.5% is accepted.
    close = replace(plan, flows={e: f * 0.997 for e, f in plan.flows.items()}, max_flow=plan.max_flow * 0.997)
    assert validate_plan(close, CLUSTER, MODEL, PROFILES) == []


def test_pruned_plans_compare_with_their_pruned_graph() -> None:
    full = plan_of(RANGES)
    busiest = max((e for e in full.flows if SOURCE not in e and SINK not in e), key=lambda e: full.flows[e])
    allowed = [e for e in valid_edges(RANGES, 60, partial=True) if SOURCE not in e and SINK not in e and e != busiest]
    result = evaluate(CLUSTER, MODEL, PROFILES, RANGES, allowed=allowed)
    assert result.value < full.max_flow * 0.99
    pruned = replace(full, flows=result.flows, max_flow=result.value)
    assert validate_plan(pruned, CLUSTER, MODEL, PROFILES, allowed=allowed) == []
    only(validate_plan(pruned, CLUSTER, MODEL, PROFILES), "differs from the max flow")
    only(validate_plan(full, CLUSTER, MODEL, PROFILES, allowed=allowed), "on a pruned connection")


def test_unlimited_links() -> None:
    free = cluster(link=None)
    plan = plan_of(RANGES, cl=free)
    assert validate_plan(plan, free, MODEL, PROFILES) == []


@pytest.mark.parametrize("seed", range(40))
def test_independent_max_flow_agrees_with_flowgraph(seed: int) -> None:
    rng = random.Random(seed)
    devices = ["a100", "l4", "t4", "v100", "2xl4", "2xt4", "4xt4"]
    regions = ["r1", "r2", "r3"][: rng.randint(1, 3)]
    nodes = tuple(NodeSpec(f"n{i}", d, rng.choice(regions), parse_device(d).memory_gb) for i, d in
                  enumerate(rng.choice(devices) for _ in range(rng.randint(8, 20))))
    links = {frozenset((a, b)): LinkSpec(rng.choice([50, 100, 1000, 10_000]), 10) for a in regions for b in regions
             if a < b}
    cl = ClusterSpec(name="r", nodes=nodes, coordinator_region=regions[0], region_links=links,
                     intra_region_link=rng.choice([None, LinkSpec(10_000, 1)]))
    profiles = rng.choice([PROFILES, roofline_profile_table(cl, MODEL)])
    partial = rng.random() < 0.7
    # Chains of nodes through the model, overlapping when partial, with a few stray ranges.
    ranges = {}
    end = 0
    for n in nodes:
        k = profiles.for_node(n.name, n.device).max_layers
        j = rng.randint(k // 2 + 1, k)
        if rng.random() < 0.1:
            first = rng.randint(0, 60 - j)
        else:
            first = min(max(0, end - (rng.randint(0, j - 1) if partial else 0)), 60 - j)
        ranges[n.name] = (first, first + j)
        end = 0 if first + j == 60 else first + j
    expected = evaluate(cl, MODEL, profiles, ranges, partial=partial).value
    got = independent_max_flow(cl, MODEL, profiles, ranges, partial=partial)
    assert got == pytest.approx(expected, rel=1e-5, abs=1e-3)
    plan = plan_of(ranges, partial=partial, cl=cl, profiles=profiles)
    problems = [p for p in validate_plan(plan, cl, MODEL, profiles) if "held by no node" not in p]
    assert problems == []
