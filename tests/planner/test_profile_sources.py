from __future__ import annotations

import json
from dataclasses import replace
from importlib.resources import files
from pathlib import Path

import pytest

from hetnode.errors import ConfigError
from hetnode.planner.all_reduce import tp_layer_s
from hetnode.planner.cluster import PCIE_LINK, LinkSpec, NodeSpec, load_cluster, uniform_cluster
from hetnode.planner.costmodel import step_time
from hetnode.planner.devices import parse_device
from hetnode.planner.model import ModelSpec, model_spec
from hetnode.planner.profile import ProfileTable, Workload, interpolate, roofline_profile, with_throughput
from hetnode.planner.profile_sources import (
    HELIX_GPUS,
    HELIX_MAX_LAYERS,
    helix_devices,
    helix_profile,
    helix_profile_table,
    load_profile_table,
    measured_profile,
    parse_profile_table,
    profile_table_for,
    profile_table_to_dict,
    roofline_profile_table,
    save_profile_table,
)

L30 = model_spec("llama-30b")
L70 = model_spec("llama-70b")
SHARED = Path("/work/shared/data/helix-profiles")


# -- Helix's measured profiles --------------------------------------------------------------------------------

@pytest.mark.parametrize("model", [L30, L70], ids=["llama-30b", "llama-70b"])
def test_helix_table_covers_every_measured_gpu(model: ModelSpec) -> None:
    table = helix_profile_table(model)
    assert set(table.profiles) == {"a100", "l4", "t4", "v100", "2xl4", "2xt4", "4xt4"} == set(HELIX_GPUS.values())
    assert table.model == model.name
    for device, prof in table.profiles.items():
        assert prof.max_layers == HELIX_MAX_LAYERS[model.name][device]
        assert prof.memory_bytes == parse_device(device).memory_bytes
        assert len(prof.throughput) == prof.max_layers
        # T_j is a per-token rate through j layers: more layers, fewer tokens per second.
        assert all(a > b > 0 for a, b in zip(prof.throughput, prof.throughput[1:], strict=False))
        assert "Helix" in prof.source


def test_helix_curves_are_the_artifact_rows_in_seconds() -> None:
    prof = helix_profile(L30, "a100")
    assert prof.prompt_curve[:3] == ((0.0, 0.0), (250.0, 0.001), (500.0, 0.002))
    assert prof.decode_curve[1] == (2.0, 0.0009)
    assert interpolate(prof.prompt_curve, 375) == pytest.approx(0.0015)
    assert prof.prefill_time(750, 18) == pytest.approx(18 * 0.004)  # the 750,4 row, for 18 layers


def test_multi_gpu_directories_map_to_our_names() -> None:
    prof = helix_profile(L70, "4xT4")
    assert prof.name == "4xt4"
    assert prof.max_layers == 18
    assert prof.memory_bytes == 4 * 16 * 2**30


@pytest.mark.skipif(not SHARED.exists(), reason="the shared copy of the artifact's profiles is not here")
def test_shipped_csvs_are_unchanged_copies() -> None:
    from importlib.resources import files

    ours = Path(str(files("hetnode.planner") / "data" / "helix"))
    # The per-model, per-GPU profiles (model/gpu/*.csv) and vLLM's measured KV capacities and step caps.
    theirs = sorted([*(p.relative_to(SHARED) for p in SHARED.glob("*/*/*.csv")), Path("vllm_capacity.csv")])
    assert theirs and theirs == sorted(p.relative_to(ours) for p in ours.rglob("*.csv"))
    for rel in theirs:
        assert (ours / rel).read_bytes() == (SHARED / rel).read_bytes()


def test_helix_refuses_other_models() -> None:
    with pytest.raises(ConfigError, match="llama-30b, llama-70b"):
        helix_profile_table(model_spec("llama3-8b"))
    # A model file that only borrows the name is not what Helix measured either.
    fake = ModelSpec("llama-30b", 30, 6656, 17920, 52, 52, 32000)
    with pytest.raises(ConfigError):
        helix_profile_table(fake)
    assert helix_devices(fake) == []
    with pytest.raises(ConfigError, match="no profile of 'h100'"):
        helix_profile(L30, "h100")


def test_kv_share_scales_helix_layer_counts() -> None:
    assert helix_profile(L30, "a100", kv_share=0.5).max_layers == 18
    assert helix_profile(L30, "a100", kv_share=0.75).max_layers == 9
    assert helix_profile(L30, "a100", kv_share=0.25).max_layers == 27
    assert helix_profile(L30, "4xt4", kv_share=0.0).max_layers == 60  # capped at the model's layers
    with pytest.raises(ConfigError, match="kv-share"):
        helix_profile_table(L30, kv_share=1.0)


# -- roofline and measured ------------------------------------------------------------------------------------

def test_roofline_table_has_one_profile_per_device_type() -> None:
    cluster = uniform_cluster(3, "l4")
    cluster = cluster.__class__(name="mix", nodes=(*cluster.nodes, NodeSpec("big", "a100", "local", 40.0),
                                                   NodeSpec("small", "a100", "local", 20.0)),
                                coordinator_region="local")
    table = roofline_profile_table(cluster, L30, kv_share=0.4)
    assert set(table.profiles) == {"l4", "a100", "small"}  # "small" overrides its memory
    assert table.profiles["l4"] == roofline_profile(parse_device("l4"), L30, kv_share=0.4)
    assert table.profiles["small"].memory_bytes == 20 * 2**30
    assert table.profiles["small"].max_layers < table.profiles["a100"].max_layers
    assert table.for_node("small", "a100").name == "small"
    assert table.for_node("big", "a100").name == "a100"


def test_a_multi_gpu_roofline_node_pays_its_all_reduces_over_pcie() -> None:
    """A "4xa6000" instance of a cluster file (thunderserve-cloud) is tensor parallel over its four GPUs: each
    layer's step pays tp_layer_s(4, ...) over the cluster files' PCIe link, as ThunderServe's TP stages do."""
    cloud = load_cluster(str(files("hetnode.testnet") / "clusters" / "thunderserve-cloud.toml"))
    assert cloud.node("4xa6000-0").gpu_link is None
    table = roofline_profile_table(cloud, L30)
    four = parse_device("4xa6000")
    prof = table.for_node("4xa6000-0", "4xa6000")
    bps, latency = PCIE_LINK.bandwidth_mbps * 1e6 / 8, PCIE_LINK.latency_ms / 1e3
    bpe = round(L30.bytes_per_param)
    for n, t in prof.prompt_curve:
        bare = step_time(four, L30.shape, 1, round(n), round(n), attended_pairs=round(n) * (round(n) + 1) // 2,
                         bytes_per_elem=bpe)
        assert t - bare == pytest.approx(tp_layer_s(4, n, L30.activation_bytes, bps, latency), rel=1e-9)
    for b, t in prof.decode_curve:
        bare = step_time(four, L30.shape, 1, round(b), 0, bytes_per_elem=bpe)
        assert t - bare == pytest.approx(tp_layer_s(4, b, L30.activation_bytes, bps, latency), rel=1e-9)
    assert tp_layer_s(4, 2048, L30.activation_bytes, bps, latency) > 0.01 * dict(prof.prompt_curve)[2048.0]
    # One GPU pays nothing; a faster link of its own (NodeSpec.gpu_link) less, in a profile of its own.
    one = parse_device("a6000")
    for n, t in roofline_profile(one, L30).prompt_curve:
        k = round(n)
        assert t == step_time(one, L30.shape, 1, k, k, attended_pairs=k * (k + 1) // 2, bytes_per_elem=bpe)
    nv = replace(cloud, nodes=(replace(cloud.node("4xa6000-0"), gpu_link=LinkSpec(2_400_000, 0.005)),))
    fast = roofline_profile_table(nv, L30).for_node("4xa6000-0", "4xa6000")
    assert fast.name == "4xa6000-0" and dict(fast.prompt_curve)[2048.0] < dict(prof.prompt_curve)[2048.0]


def test_measured_multi_gpu_profiles_pay_nothing_more() -> None:
    """Helix's 2xl4 and 4xt4 were measured with vLLM running tensor parallel: their all-reduces are in the
    numbers, so the profile is the artifact's curves as they are."""
    for device, gpu_dir in (("2xl4", "l4x2"), ("4xt4", "t4x4")):
        prof = helix_profile(L30, device)
        root = Path(str(files("hetnode.planner") / "data" / "helix" / "llama1_30b" / gpu_dir))
        rows = [line.split(",") for line in (root / "prompt_bs2time.csv").read_text().splitlines() if line.strip()]
        assert prof.prompt_curve == tuple((float(x), float(ms) / 1e3) for x, ms in rows)


def test_measured_profile_runs_the_roofline_at_the_measured_rates() -> None:
    a100 = parse_device("a100")
    # Peak figures (an emulated node) give exactly the table roofline.
    peak = measured_profile("n1", a100.fp16_tflops, a100.mem_bandwidth_gbps, a100.memory_bytes, L30, 0.5,
                            achieved=False)
    assert peak.throughput == roofline_profile(a100, L30).throughput
    assert peak.name == "n1"
    # Measured rates run at those rates: the same numbers measured are faster than the same numbers as peaks.
    fast = measured_profile("n1", a100.fp16_tflops, a100.mem_bandwidth_gbps, a100.memory_bytes, L30, 0.5)
    assert all(f > p for f, p in zip(fast.throughput, peak.throughput, strict=True))
    half = measured_profile("n1", a100.fp16_tflops / 2, a100.mem_bandwidth_gbps / 2, a100.memory_bytes, L30)
    assert half.throughput[0] == pytest.approx(fast.throughput[0] / 2, rel=0.05)
    with pytest.raises(ConfigError, match="matmul_tflops"):
        measured_profile("n1", 0.0, 100.0, 2**30, L30)


# -- choosing a source ----------------------------------------------------------------------------------------

def test_auto_uses_helix_only_where_it_measured_everything() -> None:
    helix_cluster = uniform_cluster(2, "t4")
    assert profile_table_for(helix_cluster, L70).source.startswith("helix")
    assert profile_table_for(helix_cluster, L70, "roofline").source.startswith("roofline")
    assert profile_table_for(uniform_cluster(2, "h100"), L70).source.startswith("roofline")  # no h100 profile
    assert profile_table_for(helix_cluster, model_spec("llama3-8b")).source.startswith("roofline")
    with pytest.raises(ConfigError, match="h100"):
        profile_table_for(uniform_cluster(2, "h100"), L70, "helix")


def test_a_file_must_cover_the_cluster(tmp_path: Path) -> None:
    path = tmp_path / "t.toml"
    path.write_text('[devices.t4]\nmax_layers = 2\nthroughput = [200, 100]\n')
    table = profile_table_for(uniform_cluster(2, "t4"), L30, str(path))
    assert table.for_node("node-0", "t4").throughput == (200.0, 100.0)
    with pytest.raises(ConfigError, match="l4") as info:
        profile_table_for(uniform_cluster(2, "l4"), L30, str(path))
    assert info.value.file == str(path)
    with pytest.raises(ConfigError, match="cannot read") as info:
        profile_table_for(uniform_cluster(2, "l4"), L30, str(tmp_path / "missing.toml"))


# -- files ----------------------------------------------------------------------------------------------------

TABLE = """
model = "llama-30b"
description = "hand-made"

[workload]
input_len = 500
output_len = 100

[devices.a100]
max_layers = 3
throughput = [3000, 1500, 1000]

[devices.L4]
max_layers = 2
prompt_ms = [[0, 0], [256, 2.0], [1024, 8.0]]
decode_ms = [[1, 1.0], [64, 2.0], [256, 6.0]]
decode_context_ms = 0.0001

[nodes.box-1]
device = "t4"
max_layers = 1
throughput = [42]
source = "measured on the testnet"
"""


def test_load_a_table_with_throughputs_and_curves(tmp_path: Path) -> None:
    path = tmp_path / "table.toml"
    path.write_text(TABLE)
    table = load_profile_table(path, L30)
    assert table.source == "hand-made"
    assert set(table.profiles) == {"a100", "l4", "box-1"}
    a100 = table.profiles["a100"]
    assert a100.throughput == (3000.0, 1500.0, 1000.0)
    assert a100.memory_bytes == 40 * 2**30
    # Given only throughputs, step times run at the node's full rate (T_k through k layers).
    assert a100.decode_time(1000, 3) == pytest.approx(1000 / 1000)
    l4 = table.profiles["l4"]
    assert l4.prompt_curve == ((0.0, 0.0), (256.0, 0.002), (1024.0, 0.008))
    assert l4.decode_context_s == pytest.approx(1e-7)
    expected = with_throughput(l4, L30, Workload(input_len=500, output_len=100))
    assert l4.throughput == expected.throughput and len(l4.throughput) == 2
    box = table.profiles["box-1"]
    assert (box.memory_bytes, box.source, box.throughput) == (16 * 2**30, "measured on the testnet", (42.0,))
    assert table.for_node("box-1", "a100") is box


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_save_and_load_round_trip(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / "table.toml"
    path.write_text(TABLE)
    table = load_profile_table(path, L30)
    helix = helix_profile_table(L30)
    both = ProfileTable(model=table.model, profiles={**helix.profiles, **table.profiles}, source="merged")
    out = tmp_path / f"out{suffix}"
    save_profile_table(both, out)
    if suffix == ".json":
        json.loads(out.read_text())
    again = load_profile_table(out, L30)
    assert again.source == "merged"
    assert set(again.profiles) == set(both.profiles)
    for name, prof in both.profiles.items():
        back = again.profiles[name]
        assert back.throughput == prof.throughput  # exactly
        assert (back.name, back.max_layers, back.memory_bytes, back.source) == (
            prof.name, prof.max_layers, prof.memory_bytes, prof.source)
        for mine, theirs in ((prof.prompt_curve, back.prompt_curve), (prof.decode_curve, back.decode_curve)):
            assert [x for x, _ in mine] == [x for x, _ in theirs]
            assert [y for _, y in theirs] == pytest.approx([y for _, y in mine], rel=1e-12)
        assert back.decode_context_s == pytest.approx(prof.decode_context_s, rel=1e-12)
    assert "box-1" in profile_table_to_dict(both)["nodes"]
    assert "a100" in profile_table_to_dict(both)["devices"]


def test_a_measured_table_round_trips() -> None:
    a100 = parse_device("a100")
    prof = measured_profile("gpu-host-7", 200.0, 1400.0, a100.memory_bytes, L70)
    table = ProfileTable(model=L70.name, profiles={"gpu-host-7": prof}, source="testnet")
    again = parse_profile_table(profile_table_to_dict(table), L70, "mem")
    assert again.profiles["gpu-host-7"].throughput == prof.throughput


BAD = [
    ('model = "llama-70b"\n[devices.a100]\nmax_layers = 1\nthroughput = [1]', "model", "not for 'llama-30b'"),
    ('[devices.a100]\nmax_layers = 1\nthroughput = [1]\nspeed = 3', "devices.a100.speed", "unknown key"),
    ('[devices.b200]\nmax_layers = 1\nthroughput = [1]', "devices.b200", "unknown device"),
    ('[devices.a100]\nthroughput = [1]', "devices.a100.max_layers", "missing required key"),
    ('[devices.a100]\nmax_layers = 61\nthroughput = [1]', "devices.a100.max_layers", "1..60"),
    ('[devices.a100]\nmax_layers = true\nthroughput = [1]', "devices.a100.max_layers", "not a boolean"),
    ('[devices.a100]\nmax_layers = 2\nthroughput = [1]', "devices.a100.throughput", "exactly 2"),
    ('[devices.a100]\nmax_layers = 2\nthroughput = [1, 0]', "devices.a100.throughput[1]", "> 0"),
    ('[devices.a100]\nmax_layers = 2\nthroughput = [1, "x"]', "devices.a100.throughput[1]", "not a string"),
    ('[devices.a100]\nmax_layers = 2\nthroughput = [1, inf]', "devices.a100.throughput[1]", "finite"),
    ('[devices.a100]\nmax_layers = 2', "devices.a100", "needs throughput"),
    ('[devices.a100]\nmax_layers = 2\nprompt_ms = [[1, 1]]', "devices.a100.decode_ms", "pair"),
    ('[devices.a100]\nmax_layers = 2\nprompt_ms = [[2, 1], [1, 2]]\ndecode_ms = [[1, 1]]',
     "devices.a100.prompt_ms[1][0]", "must increase"),
    ('[devices.a100]\nmax_layers = 2\nprompt_ms = [[2, 1, 3]]\ndecode_ms = [[1, 1]]',
     "devices.a100.prompt_ms[0]", "pair"),
    ('[devices.a100]\nmax_layers = 2\nprompt_ms = [[2, -1]]\ndecode_ms = [[1, 1]]',
     "devices.a100.prompt_ms[0][1]", ">= 0"),
    ('[devices.a100]\nmax_layers = 2\nprompt_ms = [[0, 0]]\ndecode_ms = [[1, 1]]', "devices.a100.prompt_ms", "> 0"),
    ('[devices.a100]\nmax_layers = 2\nprompt_ms = []\ndecode_ms = [[1, 1]]', "devices.a100.prompt_ms", "non-empty"),
    ('[devices.a100]\nmax_layers = 1\nthroughput = [1]\n[devices.A100]\nmax_layers = 1\nthroughput = [1]',
     "devices.A100", "second entry"),
    ('[nodes.box]\nmax_layers = 1\nthroughput = [1]', "nodes.box.memory_gb", "device"),
    ('[nodes.Box]\nmax_layers = 1\nthroughput = [1]\nmemory_gb = 4', "nodes.Box", "node name"),
    ('[nodes.box]\ndevice = "zz"\nmax_layers = 1\nthroughput = [1]', "nodes.box.device", "unknown device"),
    ('[nodes.box]\nmemory_gb = 0\nmax_layers = 1\nthroughput = [1]', "nodes.box.memory_gb", "> 0"),
    ('[devices]\na100 = 3', "devices.a100", "must be a table"),
    ('devices = 3', "devices", "table of entries"),
    ('[workload]\ninput_len = 0\n[devices.a100]\nmax_layers = 1\nthroughput = [1]', "workload.input_len", "1.."),
    ('description = "nothing"', None, "at least one entry"),
]


@pytest.mark.parametrize("text, key, problem", BAD)
def test_bad_tables_name_file_key_and_problem(tmp_path: Path, text: str, key: str | None, problem: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_profile_table(path, L30)
    assert info.value.file == str(path)
    assert info.value.key == key
    assert problem in info.value.problem


def test_bad_syntax(tmp_path: Path) -> None:
    for name, text, kind in (("t.toml", "[devices.a100", "TOML"), ("t.json", "{", "JSON")):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError, match=f"invalid {kind}"):
            load_profile_table(path, L30)

