"""Tensor-parallel stages in the simulator: each stage of a ThunderServe plan becomes one node of its GPUs, the
links its first GPU has, and the simulator serves the plan's replicas with them."""

from __future__ import annotations

from dataclasses import replace
from importlib.resources import files

import pytest

from hetnode.errors import ConfigError
from hetnode.planner.all_reduce import ring_all_reduce_s
from hetnode.planner.cluster import PCIE_LINK, load_cluster
from hetnode.planner.costmodel import step_time
from hetnode.planner.devices import parse_device
from hetnode.planner.model import model_spec
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.planner.profile_sources import profile_table_for
from hetnode.planner.thunderserve.deploy import thunderserve_placement
from hetnode.planner.thunderserve.gpus import gpu_pool
from hetnode.planner.thunderserve.parallel import Layout, Stage, performance
from hetnode.planner.thunderserve.settings import CODING, ThunderServeOptions, Traffic
from hetnode.testnet.sim import SimOptions, load_trace, poisson, simulate
from hetnode.testnet.sim.tp_stages import merge_tensor_parallel
from hetnode.testnet.sim.workload import Trace

CLOUD = load_cluster(str(files("hetnode.testnet") / "clusters" / "thunderserve-cloud-gpus.toml"))
MODEL = model_spec("llama-30b")


def two_replicas() -> PlacementPlan:
    """A prefill replica of two TP-2 stages on two hosts, and a decode replica of one TP-4 stage."""
    p0, p1 = ("4xa6000-0-gpu0", "4xa6000-0-gpu1"), ("4x3090ti-0-gpu0", "4x3090ti-0-gpu1")
    d = tuple(f"4xa5000-0-gpu{k}" for k in range(4))
    placements = [NodePlacement(n, 0, 40) for n in p0] + [NodePlacement(n, 40, 60) for n in p1]
    placements += [NodePlacement(n, 0, 60) for n in d]
    return PlacementPlan(cluster=CLOUD.name, model=MODEL.name, num_layers=60, method="thunderserve",
                         placements=tuple(placements), partial_inference=False,
                         replicas=(Replica("prefill", p0 + p1, tp=2), Replica("decode", d, tp=4)))


def test_each_stage_becomes_one_node_of_its_gpus() -> None:
    plan, cluster = merge_tensor_parallel(two_replicas(), CLOUD)
    assert [r.nodes for r in plan.replicas] == [("4xa6000-0-gpu0", "4x3090ti-0-gpu0"), ("4xa5000-0-gpu0",)]
    assert all(r.tp == 1 for r in plan.replicas)
    assert plan.ranges() == {"4xa6000-0-gpu0": (0, 40), "4x3090ti-0-gpu0": (40, 60), "4xa5000-0-gpu0": (0, 60)}
    a6000 = cluster.node("4xa6000-0-gpu0")
    assert a6000.device == "2xa6000" and a6000.memory_gb == 2 * CLOUD.node("4xa6000-0-gpu0").memory_gb
    assert cluster.node("4xa5000-0-gpu0").device_spec.fp16_tflops == pytest.approx(
        4 * CLOUD.node("4xa5000-0-gpu0").device_spec.fp16_tflops)
    names = {n.name for n in cluster.nodes}
    assert "4xa6000-0-gpu1" not in names and "4xa5000-0-gpu3" not in names
    assert "4xa6000-0-gpu2" in names  # GPUs outside every stage stay as they are
    assert len(cluster.nodes) == len(CLOUD.nodes) - 1 - 1 - 3
    # A stage keeps the links of its first GPU: between hosts and inside one.
    for a, b in (("4xa6000-0-gpu0", "4x3090ti-0-gpu0"), ("4xa6000-0-gpu0", "4xa6000-0-gpu2")):
        assert cluster.link(a, b) == CLOUD.link(a, b)


def test_a_plan_without_tensor_parallel_is_unchanged_and_bad_stages_are_refused() -> None:
    plan = two_replicas()
    flat = replace(plan, replicas=tuple(replace(r, tp=1) for r in plan.replicas))
    assert merge_tensor_parallel(flat, CLOUD) == (flat, CLOUD)
    mixed = replace(plan, replicas=(Replica("prefill", ("4xa6000-0-gpu0", "4x3090ti-0-gpu0"), tp=2),
                                    plan.replicas[1]))
    with pytest.raises(ConfigError, match="not GPUs of one type and host"):
        merge_tensor_parallel(mixed, CLOUD)
    odd = replace(plan, replicas=(replace(plan.replicas[0], tp=3), plan.replicas[1]))
    with pytest.raises(ConfigError, match="does not divide"):
        merge_tensor_parallel(odd, CLOUD)


def test_the_simulator_serves_a_thunderserve_plan_with_tensor_parallel_stages() -> None:
    options = ThunderServeOptions(traffic=replace(CODING, rate=2.0), steps=5, neighbours=5)
    plan = thunderserve_placement(CLOUD, MODEL, options)
    assert any(r.tp > 1 for r in plan.replicas)
    merged = merge_tensor_parallel(plan, CLOUD)[1]
    profiles = profile_table_for(merged, MODEL, "roofline", kv_share=options.kv_reserve)
    result = simulate(CLOUD, MODEL, profiles, plan, workload=poisson(1.0, lengths=load_trace("code"),
                                                                     duration_s=30.0), duration_s=30.0,
                      warmup_s=5.0)
    done = [r for r in result.requests if r.measured and r.finished]
    assert done and all(r.generated == r.output_len for r in done)
    stages = {n for r in merge_tensor_parallel(plan, CLOUD)[0].replicas for n in r.nodes}
    assert {n.name for n in result.nodes if n.busy_s > 0} <= stages
    assert result.summary["kv_handoff"]["installs"] >= len(done)  # every request moved its KV between phases


def test_a_tp_stage_pays_the_all_reduces_the_planner_charges() -> None:
    """Issue 14: the simulator's TP stage took the aggregate device's roofline alone, so it prefilled faster
    than ThunderServe's planner expected; now a prompt on a stage costs what the planner prices it at, once."""
    plan = two_replicas()
    merged = merge_tensor_parallel(plan, CLOUD)[1]
    table = profile_table_for(merged, MODEL, "roofline")
    options = ThunderServeOptions(traffic=Traffic(input_len=2048.0, output_len=28.0))
    pool = gpu_pool(CLOUD)
    index = {g.name: i for i, g in enumerate(pool.gpus)}
    stage = Stage((index["4xa6000-0-gpu0"], index["4xa6000-0-gpu1"]), 0, 40)
    planner = performance(pool, Layout(tp=2, stages=(stage,)), MODEL, options).prefill_s
    node = table.for_node("4xa6000-0-gpu0", "2xa6000")
    assert 40 * dict(node.prompt_curve)[2048.0] == pytest.approx(planner, rel=1e-9)
    bare = step_time(parse_device("2xa6000"), MODEL.shape, 1, 2048, 2048, attended_pairs=2048 * 2049 // 2,
                     bytes_per_elem=round(MODEL.bytes_per_param))
    assert 40 * bare < 0.95 * planner  # what the simulator charged before
    # Decode steps pay them too, per item; the TP-4 stage over its own host's link.
    link = CLOUD.link("4xa5000-0-gpu0", "4xa5000-0-gpu1")
    assert merged.node("4xa5000-0-gpu0").gpu_link == link
    d4 = table.for_node("4xa5000-0-gpu0", "4xa5000")
    for b, t in d4.decode_curve:
        t0 = step_time(parse_device("4xa5000"), MODEL.shape, 1, round(b), 0,
                       bytes_per_elem=round(MODEL.bytes_per_param))
        assert t - t0 == pytest.approx(2 * ring_all_reduce_s(4, b * MODEL.activation_bytes,
                                                             link.bandwidth_mbps * 1e6 / 8, link.latency_ms / 1e3))


def test_a_stage_on_a_faster_link_gets_a_profile_of_its_own() -> None:
    """Stages of an NVLink server all-reduce over NVLink, not the PCIe a cluster file's multi-GPU node gets."""
    a100 = load_cluster(str(files("hetnode.testnet") / "clusters" / "thunderserve-a100.toml"))
    gpus = tuple(n.name for n in a100.nodes[:2])
    plan = PlacementPlan(cluster=a100.name, model=MODEL.name, num_layers=60, method="thunderserve",
                         placements=tuple(NodePlacement(n, 0, 60) for n in gpus), partial_inference=False,
                         replicas=(Replica("prefill", gpus, tp=2),))
    merged = merge_tensor_parallel(plan, a100)[1]
    table = profile_table_for(merged, MODEL, "roofline")
    nvlink = a100.link(*gpus)
    assert merged.node(gpus[0]).gpu_link == nvlink and nvlink.bandwidth_mbps > PCIE_LINK.bandwidth_mbps
    own, pcie = table.for_node(gpus[0], merged.node(gpus[0]).device), table.profiles[merged.node(gpus[0]).device]
    assert own is not pcie
    pool = gpu_pool(a100)
    options = ThunderServeOptions(traffic=Traffic(input_len=2048.0, output_len=28.0))
    planner = performance(pool, Layout(tp=2, stages=(Stage((0, 1), 0, 60),)), MODEL, options).prefill_s
    assert 60 * dict(own.prompt_curve)[2048.0] == pytest.approx(planner, rel=1e-9)
    assert dict(pcie.prompt_curve)[2048.0] > dict(own.prompt_curve)[2048.0]


def test_a_prefill_replicas_stages_take_the_prefill_token_cap_by_role_and_the_decode_stage_does_not() -> None:
    """SimOptions.prefill_tokens reaches the merged TP stages of prefill replicas (role_batching.py): prompts of
    2,048 tokens queued for the prefill replica run one to a step under a 1,024 cap, where the shared setting
    (8,192 tokens a step) batches several; the decode stage batches either way."""
    plan = two_replicas()
    merged = merge_tensor_parallel(plan, CLOUD)[1]
    profiles = profile_table_for(merged, MODEL, "roofline")
    lengths = Trace("2048-in", tuple(float(i) for i in range(100)), (2048,) * 100, (64,) * 100)
    workload = poisson(3.0, lengths=lengths, duration_s=20.0)
    prefill = {"4xa6000-0-gpu0", "4x3090ti-0-gpu0"}
    batches = {}
    for cap in (None, 1024):
        result = simulate(CLOUD, MODEL, profiles, plan, workload=workload, scheduler="cls",
                          duration_s=20.0, warmup_s=2.0, options=SimOptions(prefill_tokens=cap))
        batches[cap] = {n.name: n.max_batch for n in result.nodes if n.steps}
    assert max(batches[None][n] for n in prefill) > 1
    assert all(batches[1024][n] == 1 for n in prefill)
    assert batches[None]["4xa5000-0-gpu0"] > 1 and batches[1024]["4xa5000-0-gpu0"] > 1
