"""The first phase-split plan: roles by prefill/decode affinity, the cut by the workload, replicas per role."""

from __future__ import annotations

import itertools

import pytest

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec, LinkSpec, NodeSpec
from hetnode.planner.model import model_spec
from hetnode.planner.placement import plan_placement
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.profile import Workload
from hetnode.planner.profile_sources import profile_table_for
from hetnode.planner.split import node_rates, split_placement
from hetnode.planner.validate import validate_plan

SMOL = model_spec("smollm2-135m")
LAN = LinkSpec(bandwidth_mbps=1000, latency_ms=1)


def cluster(*nodes: tuple[str, str, str, float | None]) -> ClusterSpec:
    """Nodes as (name, device, region, memory GiB or None for the device's)."""
    from hetnode.planner.devices import parse_device

    return ClusterSpec(name="t", coordinator_region="us", default_link=LAN, nodes=tuple(
        NodeSpec(n, d, r, m if m is not None else parse_device(d).memory_bytes / 2**30) for n, d, r, m in nodes))


def split(c: ClusterSpec, workload: Workload | None = None) -> PlacementPlan:
    profiles = profile_table_for(c, SMOL, "auto", kv_share=0.5)
    plan = split_placement(c, SMOL, profiles, workload=workload)
    assert validate_plan(plan, c, SMOL, profiles) == []
    return plan


def roles(plan: PlacementPlan) -> dict[str, list[tuple[str, ...]]]:
    out: dict[str, list[tuple[str, ...]]] = {"prefill": [], "decode": []}
    for r in plan.replicas:
        out[r.role].append(r.nodes)
    return out


def test_the_node_with_the_most_compute_per_byte_of_bandwidth_prefills() -> None:
    c = cluster(("a100", "a100", "us", None), ("l4", "l4", "us", None), ("t4", "t4", "us", None))
    profiles = profile_table_for(c, SMOL, "auto", kv_share=0.5)
    rates = {n.name: node_rates(profiles.for_node(n.name, n.device), SMOL, Workload(), 30) for n in c.nodes}
    strongest = max(rates, key=lambda n: rates[n].affinity)
    plan = split(c)
    assert roles(plan)["prefill"][0] == (strongest,)
    assert all(r.role == "decode" for r in plan.replicas if r.nodes != (strongest,))


def test_on_identical_nodes_the_cut_follows_the_workload() -> None:
    c = cluster(*((f"n{i}", "l4", "us", None) for i in range(8)))
    long_prompts = roles(split(c, Workload(input_len=4000, output_len=50)))
    long_outputs = roles(split(c, Workload(input_len=50, output_len=4000)))
    assert len(long_prompts["prefill"]) > len(long_outputs["prefill"])
    assert len(long_outputs["decode"]) > len(long_prompts["decode"])
    for r in (long_prompts, long_outputs):
        assert r["prefill"] and r["decode"] and len(r["prefill"]) + len(r["decode"]) == 8


def test_nodes_too_small_for_the_model_are_chained_into_replicas() -> None:
    small = 22.5 * SMOL.layer_bytes * 2 / 2**30  # holds 22 of 30 layers beside its KV share
    c = cluster(("s0", "l4", "us", small), ("s1", "l4", "us", small), ("s2", "l4", "us", small),
                ("s3", "l4", "us", small), ("big", "l4", "us", None))
    plan = split(c)
    sizes = sorted(len(r.nodes) for r in plan.replicas)
    assert sizes == [1, 2, 2]  # the big node alone, the small ones in pairs
    for r in plan.replicas:
        ranges = [plan.ranges()[n] for n in r.nodes]
        assert ranges[0][0] == 0 and ranges[-1][1] == 30
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert plan.connections is not None and set(plan.connections) == {
        (a, b) for r in plan.replicas for a, b in itertools.pairwise(r.nodes)}


def test_the_plan_round_trips_through_json_and_plan_placement_makes_it() -> None:
    c = cluster(("a", "l4", "us", None), ("b", "t4", "eu", None))
    plan = split(c)
    assert PlacementPlan.from_json(plan.to_json()).replicas == plan.replicas
    profiles = profile_table_for(c, SMOL, "auto", kv_share=0.5)
    assert plan_placement(c, SMOL, profiles, method="split").replicas == plan.replicas


def test_a_plan_of_replicas_says_its_roles_where_a_helix_plan_says_its_max_flow() -> None:
    c = cluster(("a", "l4", "us", None), ("b", "t4", "eu", None), ("c", "t4", "eu", None))
    assert split(c).size == "1 prefill, 2 decode"
    profiles = profile_table_for(c, SMOL, "auto", kv_share=0.5)
    helix = plan_placement(c, SMOL, profiles, method="petals")
    assert helix.size == f"max flow {helix.max_flow:.1f} tokens/s"


def test_clusters_that_cannot_be_split_get_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="at least two nodes"):
        split(cluster(("a", "l4", "us", None)))
    small = 20.5 * SMOL.layer_bytes * 2 / 2**30
    with pytest.raises(ConfigError, match="cannot be split"):
        split(cluster(("a", "l4", "us", small), ("b", "l4", "us", small), ("c", "l4", "us", small)))
