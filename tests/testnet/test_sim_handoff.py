"""Phase-split routes in the simulator: a KV hand-off takes what its pack, link and unpack times add up to, layer by
layer during the prefill step or whole after it; decode starts only once every layer has come; a decode hop
without KV memory refuses the session before any prefill (cause "full"), and the lifecycle policy decides."""

from __future__ import annotations

from typing import Any

import pytest
from sim_helpers import PROFILE, PROFILES, TOY, keep_nodes

from hetnode.coordinator.split_scheduler import SplitScheduler
from hetnode.planner.cluster import ClusterSpec, parse_cluster
from hetnode.planner.model import TOKEN_BYTES
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.policy import CodecOption, KVCodecPolicy, LinkEstimate
from hetnode.protocol.kv_wire import packed_size
from hetnode.testnet.sim import SimOptions, Workload, simulate
from hetnode.testnet.sim.handoff import KVTransfer

C_BPS, C_LAT = 1e6, 0.005  # coordinator links: 8 Mbit/s, 5 ms
KV_BPS, KV_LAT = 3.2e7, 0.020  # prefill -> decode: 256 Mbit/s, 20 ms
KV_LAYER = 1000 * 256  # a 1000-token context's KV of one layer at fp16 (TOY: 2 x 4 heads x 16 x 2 bytes a token)
PACK, UNPACK = KV_LAYER / 0.005, KV_LAYER / 0.004  # 5 ms to pack a layer of it, 4 ms to unpack one
RATES = {"fp16": (PACK, UNPACK), "int8": (PACK, UNPACK), "int4": (PACK, UNPACK)}


def cluster(nodes: list[str], links: list[tuple[str, str, float, float]]) -> ClusterSpec:
    """Nodes in one region; every node linked to the coordinator (C_BPS, C_LAT) and the given node pairs
    (bytes/s, seconds)."""
    pairs = [{"a": "coordinator", "b": n, "bandwidth_mbps": C_BPS * 8 / 1e6, "latency_ms": C_LAT * 1e3} for n in nodes]
    pairs += [{"a": a, "b": b, "bandwidth_mbps": bps * 8 / 1e6, "latency_ms": lat * 1e3} for a, b, bps, lat in links]
    return parse_cluster({"name": "split", "coordinator": {"region": "r"},
                          "nodes": [{"name": n, "device": "a100", "region": "r"} for n in nodes],
                          "links": {"pairs": pairs}}, "test")


def plan(prefill: dict[str, tuple[int, int]], decode: dict[str, tuple[int, int]]) -> PlacementPlan:
    ranges = {**prefill, **decode}
    return PlacementPlan(cluster="split", model="toy", num_layers=4, method="split",
                         placements=tuple(NodePlacement(n, a, b) for n, (a, b) in ranges.items()),
                         replicas=(Replica("prefill", tuple(prefill)), Replica("decode", tuple(decode))))


def one(input_len: int, output_len: int) -> Workload:
    return Workload(name="one", inputs=(input_len,), outputs=(output_len,), arrivals=(1.0,))


def run(spec: ClusterSpec, placement: PlacementPlan, workload: Workload, **options: Any) -> Any:
    scheduler = options.pop("scheduler", "iwrr")
    opts = SimOptions(**{"kv_codec": "fp16", "kv_codec_rates": RATES, **options})
    return simulate(spec, TOY, PROFILES, placement, workload=workload, duration_s=100.0, warmup_s=0.0,
                    options=opts, scheduler=scheduler)


def pd() -> tuple[ClusterSpec, PlacementPlan]:
    return cluster(["p", "d"], [("p", "d", KV_BPS, KV_LAT)]), plan({"p": (0, 4)}, {"d": (0, 4)})


def prefill_end() -> float:
    """The prefill phase samples the first token: d's Install and Ready round trip, the context to p (4 bytes a
    token), p's prefill of the four layers."""
    context_sent = 1.0 + 2 * C_LAT
    return context_sent + 1000 * TOKEN_BYTES / C_BPS + C_LAT + PROFILE.prefill_time(1000, 4)


def decode_tokens(kv_done: float) -> tuple[float, float]:
    """d decodes from its last layer's KV on (the first token is there by then): two tokens, each streamed to the
    coordinator; d loops the second straight back to itself."""
    d1 = PROFILE.decode_time(1, 4, 1001)
    d2 = PROFILE.decode_time(1, 4, 1002)
    back = TOKEN_BYTES / C_BPS + C_LAT
    return kv_done + d1 + back, kv_done + d1 + d2 + back


def test_layerwise_kv_leaves_during_the_prefill_step_and_decode_starts_when_its_last_layer_is_unpacked() -> None:
    spec, placement = pd()
    result = run(spec, placement, one(1000, 3), kv_transfer="layerwise")
    (r,) = result.requests
    t4 = prefill_end()
    assert r.ttft == pytest.approx(t4 + TOKEN_BYTES / C_BPS + C_LAT - 1.0, rel=1e-12)  # never waits for KV
    # Layer j of 4 is done at t3 + (j + 1) x 12 ms; packed 5 ms later (the packer keeps up), it takes 8 ms on the
    # link and 20 ms to cross, 4 ms to unpack. The last layer is done at t4.
    tx = KV_LAYER / KV_BPS
    last = t4 + 0.005 + tx + KV_LAT + 0.004
    assert tx == pytest.approx(0.008)
    assert r.handoff == pytest.approx(last - t4, rel=1e-9)
    second, third = decode_tokens(last)
    assert r.max_tbt == pytest.approx(second - r.first_token, rel=1e-12)  # the gap the hand-off makes
    assert r.finish == pytest.approx(third, rel=1e-12)
    assert r.tpot == pytest.approx((third - r.first_token) / 2, rel=1e-12)
    assert r.path == "p[0,4) | d[0,4)" and r.depth == 1
    kv = result.summary["kv_handoff"]
    assert kv["bytes_by_codec"] == {"fp16": 4 * KV_LAYER} and kv["messages"] == 4
    assert kv["prefill_end_to_decode_s"]["mean"] == pytest.approx(0.037, rel=1e-9)
    p = next(n for n in result.nodes if n.name == "p")
    assert p.busy_s == pytest.approx(PROFILE.prefill_time(1000, 4), rel=1e-12)  # the packer runs beside it


def test_whole_kv_leaves_after_the_step_once_packed_and_the_packing_holds_the_prefill_node() -> None:
    spec, placement = pd()
    result = run(spec, placement, one(1000, 3), kv_transfer="whole")
    (r,) = result.requests
    t4 = prefill_end()
    assert r.ttft == pytest.approx(t4 + TOKEN_BYTES / C_BPS + C_LAT - 1.0, rel=1e-12)
    # The first token goes to d at t4; then p packs the four layers (20 ms), sends them as one message (32 ms on
    # the link, 20 ms across), and d unpacks them (16 ms).
    last = t4 + 4 * 0.005 + 4 * KV_LAYER / KV_BPS + KV_LAT + 4 * 0.004
    assert r.handoff == pytest.approx(last - t4, rel=1e-9)
    assert r.handoff == pytest.approx(0.088, rel=1e-9)
    assert r.finish == pytest.approx(decode_tokens(last)[1], rel=1e-12)
    kv = result.summary["kv_handoff"]
    assert kv["bytes_by_codec"] == {"fp16": 4 * KV_LAYER} and kv["messages"] == 1
    p = next(n for n in result.nodes if n.name == "p")
    assert p.busy_s == pytest.approx(PROFILE.prefill_time(1000, 4) + 0.02, rel=1e-12)


def test_a_pluggable_choice_picks_the_mode_per_link() -> None:
    spec, placement = pd()
    seen: list[KVTransfer] = []

    def by_size(t: KVTransfer) -> str:
        seen.append(t)
        return "whole" if t.wire_bytes < 1 << 20 else "layerwise"

    (r,) = run(spec, placement, one(1000, 3), kv_transfer=by_size).requests
    assert r.handoff == pytest.approx(0.088, rel=1e-9)  # 1,024,000 bytes: whole
    assert seen == [KVTransfer("p", "d", "fp16", 4, 1000, 4 * KV_LAYER, 4 * KV_LAYER, KV_BPS, KV_LAT)]


def test_decode_hops_start_when_their_own_layers_have_come() -> None:
    """p hands layers [0, 2) to d1 and [2, 4) to d2 over a slower link: d1 decodes as soon as the first token is
    there (its layers left early in the step), d2 waits for its last layer."""
    slow = KV_BPS / 4
    spec = cluster(["p", "d1", "d2"], [("p", "d1", KV_BPS, KV_LAT), ("p", "d2", slow, KV_LAT),
                                       ("d1", "d2", 1e9, 0.001)])
    placement = plan({"p": (0, 4)}, {"d1": (0, 2), "d2": (2, 4)})
    result = run(spec, placement, one(1000, 2), kv_transfer="layerwise")
    (r,) = result.requests
    t4 = prefill_end()
    # d1: layer 1 is done at t4 - 12 ms, packed, sent and unpacked by t4 + 13 ms; the token arrives at t4 + 20 ms.
    token_at_d1 = t4 + TOKEN_BYTES / KV_BPS + KV_LAT
    assert r.handoff == pytest.approx(token_at_d1 - t4, rel=1e-9)
    # d2: layer 2 leaves at t4 - 7 ms and holds the slow link 32 ms; layer 3 (packed at t4 + 5 ms) waits for it,
    # then crosses and is unpacked.
    layer3 = (t4 - 0.007) + 2 * KV_LAYER / slow + KV_LAT + 0.004
    activation = token_at_d1 + PROFILE.decode_time(1, 2, 1001) + TOY.activation_bytes / 1e9 + 0.001
    assert layer3 > activation
    second = layer3 + PROFILE.decode_time(1, 2, 1001) + TOKEN_BYTES / C_BPS + C_LAT
    assert r.finish == pytest.approx(second, rel=1e-9)
    assert r.path == "p[0,4) | d1[0,2)>d2[2,4)" and r.depth == 2


def test_the_codec_is_the_runtime_policys_choice_for_the_link_and_the_bytes_its_packed_size() -> None:
    """With --kv-codec auto, a slow link makes int4 the cheapest: the simulator asks KVCodecPolicy with the
    link's bandwidth and latency, the packed sizes of the layers and tokens, and the rates, as the coordinator."""
    slow_bps = 1e6
    spec = cluster(["p", "d"], [("p", "d", slow_bps, KV_LAT)])
    result = run(spec, plan({"p": (0, 4)}, {"d": (0, 4)}), one(1000, 2), kv_codec="auto")
    options = [CodecOption(c, packed_size(c, 4, 1000, 4, 16), *RATES[c]) for c in ("fp16", "int8", "int4")]
    want = KVCodecPolicy().choose(packed_size("fp16", 4, 1000, 4, 16), options, LinkEstimate(slow_bps, KV_LAT))
    assert want.codec == "int4"
    kv = result.summary["kv_handoff"]
    assert kv["bytes_by_codec"] == {"int4": packed_size("int4", 4, 1000, 4, 16)}
    assert kv["fp16_bytes_by_codec"] == {"int4": 4 * KV_LAYER}


def test_a_decode_hop_without_room_refuses_before_any_prefill_and_the_lifecycle_decides() -> None:
    """The scheduler believes d has room (its estimate of the pool is stale); d's real pool (64 tokens) cannot
    hold the 100 handed over: every Install is refused with cause "full", before the context goes out; the
    request moves (the runtime's Lifecycle: at most 3 moves) and then ends."""
    spec, placement = pd()
    scheduler = SplitScheduler(placement, kv_capacity={"p": 10_000, "d": 10_000}, regions={})
    result = run(spec, placement, one(100, 3), kv_capacity={"d": 64}, scheduler=scheduler)
    (r,) = result.requests
    assert "no KV memory free on d for the 100 tokens handed over" in r.rejected
    assert "gave up after 3 moves" in r.rejected
    kv = result.summary["kv_handoff"]
    assert kv["installs"] == kv["refused_full"] == 4 and kv["bytes_by_codec"] == {}
    assert all(n.steps == 0 for n in result.nodes)  # no prefill ran anywhere
    assert scheduler.running == 0 and scheduler.queue_len == 0  # every move was cancelled at the scheduler


def test_split_runs_under_load_are_deterministic_and_free_every_block(monkeypatch: pytest.MonkeyPatch) -> None:
    """Many requests on two prefill and two decode replicas: the same JSON twice (the rates are given), every
    request served, and no KV left reserved or awaited anywhere once they are done."""
    nodes = keep_nodes(monkeypatch)
    links = [(a, b, KV_BPS, KV_LAT) for a in ("p0", "p1") for b in ("d0", "d1")]
    spec = cluster(["p0", "p1", "d0", "d1"], links)
    placement = PlacementPlan(cluster="split", model="toy", num_layers=4, method="split",
                              placements=tuple(NodePlacement(n, 0, 4) for n in ("p0", "p1", "d0", "d1")),
                              replicas=(Replica("prefill", ("p0",)), Replica("prefill", ("p1",)),
                                        Replica("decode", ("d0",)), Replica("decode", ("d1",))))
    wl = Workload(name="many", inputs=tuple(50 + 97 * (i % 13) for i in range(60)),
                  outputs=tuple(2 + i % 17 for i in range(60)), arrivals=tuple(0.02 * i for i in range(60)))
    runs = [run(spec, placement, wl, kv_codec="auto", kv_transfer=mode)
            for mode in ("layerwise", "layerwise", "whole")]
    a, b = (r.to_json(requests=True) for r in runs[:2])
    a["run"] = b["run"] = None  # wall-clock time
    assert a == b
    for result in runs:
        assert result.summary["requests"]["finished"] == 60
        assert {r.path.split(" | ")[0] for r in result.requests} == {"p0[0,4)", "p1[0,4)"}
        assert all(r.handoff > 0 for r in result.requests)
    assert len(nodes) == 12
    for node in nodes:
        assert node.ledger.used == 0 and not node.kv_coming and not node.kv_held and not node.kv_first, node.name
        assert node.kv_peak > 0
    layerwise, whole = runs[0].summary, runs[2].summary
    assert layerwise["kv_handoff"]["bytes_by_codec"] == whole["kv_handoff"]["bytes_by_codec"]
    gap = "prefill_end_to_decode_s"
    assert layerwise["kv_handoff"][gap]["mean"] < whole["kv_handoff"][gap]["mean"]


def test_the_default_transfer_mode_is_the_hops_policy() -> None:
    """The simulator's default asks KVTransferPolicy what a prefill hop asks it: whole for a short transfer,
    layer by layer for a long one, from the wire bytes per token and layer and the link's bandwidth."""
    from hetnode.policy.kv_transfer import KVTransferPolicy
    from hetnode.testnet.sim.handoff import transfer_mode

    mode = transfer_mode(SimOptions().kv_transfer)
    for tokens, bps in ((16, 1.25e7), (2048, 1.25e7), (2048, 1.25e9)):
        t = KVTransfer("p", "d", "fp16", 4, tokens, tokens * 4 * 256, tokens * 4 * 256, bps, 0.001)
        assert mode(t) == KVTransferPolicy().choose(tokens, 4, 256, bps * 8 / 1e6).mode
    assert {mode(KVTransfer("p", "d", "fp16", 4, n, n * 1024, n * 1024, 1.25e7, 0.001)) for n in (16, 4096)} == {
        "whole", "layerwise"}


def test_gpu_clusters_pack_at_their_memory_bandwidth_not_this_cpus() -> None:
    """The nodes here are A100s: without given rates, the hand-off is priced and timed with memory-bound kernel
    rates at the slowest device's achieved bandwidth, not with what this machine's CPU measures."""
    from hetnode.planner.costmodel import MEMORY_EFFICIENCY
    from hetnode.planner.devices import parse_device
    from hetnode.testnet.sim.handoff import device_rates

    rates = device_rates(1e12)
    assert rates["fp16"] == (5e11, 5e11)  # reads 2 bytes and writes 2 per fp16 element
    assert rates["int4"][0] > rates["int8"][0] > rates["fp16"][0] > rates["fp32"][0]
    with pytest.raises(ValueError, match="bandwidth"):
        device_rates(0)
    spec, placement = pd()
    result = run(spec, placement, one(600, 4), kv_codec_rates=None)
    a100 = parse_device("a100").mem_bandwidth_gbps * 1e9 * MEMORY_EFFICIENCY
    assert result.summary["kv_handoff"]["codec_rates"] == {c: list(r) for c, r in sorted(device_rates(a100).items())}
