"""The served-throughput estimate (planner/served.py) and the planner's pick by it."""

from __future__ import annotations

from importlib.resources import files

import pytest

from hetnode.planner.cluster import ClusterSpec, LinkSpec, NodeSpec, load_cluster
from hetnode.planner.devices import parse_device
from hetnode.planner.flowgraph import evaluate
from hetnode.planner.model import model_spec
from hetnode.planner.placement import PlannerOptions, plan_placement
from hetnode.planner.plan import SINK, SOURCE
from hetnode.planner.profile import (
    ProfileTable,
    Workload,
    alone_batch,
    interpolate,
    kv_tokens,
    roofline_profile,
    tokens_per_s_at,
)
from hetnode.planner.profile_sources import helix_profile_table
from hetnode.planner.served import flow_paths, served_estimate


def paper(name: str) -> ClusterSpec:
    return load_cluster(str(files("hetnode.testnet") / "clusters" / f"{name}.toml"))


def test_flow_paths_decompose_the_flow() -> None:
    flows = {(SOURCE, "a"): 3.0, (SOURCE, "b"): 1.0, ("a", "c"): 2.0, ("a", "d"): 1.0, ("b", "d"): 1.0,
             ("c", SINK): 2.0, ("d", SINK): 2.0}
    paths = flow_paths(flows)
    assert paths == [(["a", "c"], 2.0), (["b", "d"], 1.0), (["a", "d"], 1.0)]  # ties: the later name
    assert flow_paths({}) == []


def test_one_node_holding_the_model_serves_its_kv_as_one_batch() -> None:
    # One node, links without latency: every request in flight is in the node's batch, and the KV binds, so
    # the estimate is its decode rate at a batch of K = kv_fill x kv_tokens / (input + output) requests.
    model = model_spec("smollm2-135m")
    prof = roofline_profile(parse_device("l4"), model)
    cluster = ClusterSpec(name="one", nodes=(NodeSpec("n", "l4", "r", 24.0),), coordinator_region="r",
                          default_link=LinkSpec(100_000, 0.0))
    table = ProfileTable(model.name, {"l4": prof})
    ranges = {"n": (0, model.num_layers)}
    w = Workload(max_batch=10**6)
    flow = evaluate(cluster, model, table, ranges)
    k = w.kv_fill * kv_tokens(prof.memory_bytes, model, model.num_layers) / (w.input_len + w.output_len)
    step = model.num_layers * (interpolate(prof.decode_curve, k) + k / w.output_len
                               * interpolate(prof.prompt_curve, w.input_len))
    # The profile's T_j carries a context cost the curves alone do not: the estimate scales to T_j.
    given = prof.tokens_per_s(model.num_layers)
    scale = tokens_per_s_at(prof, w, model.num_layers, alone_batch(prof, model, w, model.num_layers)) / given
    assert served_estimate(cluster, model, table, ranges, flow.flows, w) == pytest.approx(k / (scale * step),
                                                                                         rel=1e-6)


def test_more_kv_never_serves_less() -> None:
    cluster, model = paper("helix-single"), model_spec("llama-70b")
    table = helix_profile_table(model)
    plan = plan_placement(cluster, model, table, method="petals")
    low = served_estimate(cluster, model, table, plan.ranges(), plan.flows, Workload(kv_fill=0.3))
    high = served_estimate(cluster, model, table, plan.ranges(), plan.flows, Workload(kv_fill=0.9))
    assert 0 < low <= high


def test_helix_picks_separate_pipelines_where_its_deep_max_flow_plan_serves_less() -> None:
    # Single-cluster LLaMA-30B: the max-flow search finds a deeper plan with more max flow than SP, which in
    # the simulator serves 0.72x of SP (docs/reproducing-helix.md); the served estimate sees it.
    cluster, model = paper("helix-single"), model_spec("llama-30b")
    table = helix_profile_table(model)
    # The max-flow search's plan (its stage placement, at 0.1 s of a 3 s search here; given as ranges, so that
    # the test does not depend on how far a time-limited search gets on a loaded machine): 20 stages deep.
    deep_ranges = {"a100-0": (24, 32), "a100-1": (32, 40), "a100-2": (40, 48), "a100-3": (48, 56),
                   **{f"l4-{k}": (3 * k, 3 * k + 3) for k in range(8)},
                   "t4-0": (0, 3), "t4-1": (3, 6), "t4-10": (6, 9), "t4-11": (9, 12), "t4-2": (12, 15),
                   "t4-3": (15, 18), "t4-4": (18, 21), "t4-5": (21, 24), **{f"t4-{k}": (56, 60) for k in range(6, 10)}}
    deep = evaluate(cluster, model, table, deep_ranges, balanced=True)
    sp = plan_placement(cluster, model, table, method="sp")
    assert deep.value > sp.max_flow
    assert served_estimate(cluster, model, table, sp.ranges(), sp.flows) > \
        served_estimate(cluster, model, table, deep_ranges, deep.flows)
    picked = plan_placement(cluster, model, table, options=PlannerOptions(time_limit_s=3.0))
    assert picked.ranges() == sp.ranges() and picked.connections == sp.connections
    assert any("picked sp's placement" in n for n in picked.notes)
