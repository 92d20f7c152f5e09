"""T_j of a node inside a cluster's pipelines (profile.pipeline_throughputs), checked by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec, NodeSpec, uniform_cluster
from hetnode.planner.model import model_spec
from hetnode.planner.profile import (
    DeviceProfile,
    Workload,
    interpolate,
    kv_tokens,
    pipeline_throughputs,
    throughputs,
    typical_layers,
)
from hetnode.planner.profile_sources import helix_profile_table, in_pipelines, profile_table_for

L70 = model_spec("llama-70b")
W = Workload()


def by_hand(p: DeviceProfile, j: int, ratio: float, w: Workload = W) -> float:
    """Helix's llama70b_typical_statistics + get_typical_token_throughput, written out once more."""
    batch = w.kv_fill * kv_tokens(p.memory_bytes, L70, j) / (w.input_len + w.output_len) * ratio
    batch = max(1.0, min(float(w.max_batch), batch))
    per_layer = interpolate(p.prompt_curve, w.input_len) + w.output_len * interpolate(p.decode_curve, batch) / batch
    return (w.input_len + w.output_len) / (j * per_layer)


def test_a_uniform_cluster_gives_each_node_its_share_of_the_layers() -> None:
    # Every node as fast as the average: a node with j of L layers holds a request for j/L of its round trip.
    a100 = helix_profile_table(L70).profiles["a100"]
    out = pipeline_throughputs({"a100": a100}, {"a100": 8}, L70, W)["a100"]
    assert len(out.throughput) == a100.max_layers
    for j in range(1, a100.max_layers + 1):
        assert out.tokens_per_s(j) == pytest.approx(by_hand(a100, j, j / L70.num_layers), rel=1e-9)
        assert out.tokens_per_s(j) <= a100.tokens_per_s(j) * (1 + 1e-9)  # never more than the node alone


def test_a_fast_node_among_slow_ones_spends_less_of_the_round_trip_at_home() -> None:
    table = helix_profile_table(L70)
    profiles = {"a100": table.profiles["a100"], "t4": table.profiles["t4"]}
    mixed = pipeline_throughputs(profiles, {"a100": 1, "t4": 20}, L70, W)
    alone = pipeline_throughputs({"a100": profiles["a100"]}, {"a100": 8}, L70, W)
    # Among T4s the A100 is through its layers quickly: its decode batch (and so its T_j) is smaller.
    assert mixed["a100"].tokens_per_s(8) < alone["a100"].tokens_per_s(8)


def test_the_fixed_point_is_the_helix_recurrence() -> None:
    table = helix_profile_table(L70)
    profiles = {"a100": table.profiles["a100"], "l4": table.profiles["l4"]}
    counts = {"a100": 4, "l4": 8}
    out = pipeline_throughputs(profiles, counts, L70, W, rounds=60)
    typical = typical_layers(profiles, counts, L70.num_layers)
    # At the fixed point each type's time per layer reproduces itself through the ratio.
    layer_s = {k: 1 / (out[k].tokens_per_s(typical[k]) * typical[k]) for k in profiles}
    avg = sum(counts[k] * typical[k] * layer_s[k] for k in profiles) / sum(counts[k] * typical[k] for k in profiles)
    for k, p in profiles.items():
        for j in range(1, p.max_layers + 1):
            ratio = j * layer_s[k] / ((L70.num_layers - j) * avg + j * layer_s[k])
            assert out[k].tokens_per_s(j) == pytest.approx(by_hand(p, j, ratio), rel=1e-6)


def test_typical_layers_follow_helix_table() -> None:
    table = helix_profile_table(L70)
    names = ("a100", "2xl4", "t4", "2xt4", "4xt4", "v100")
    profiles = {k: table.profiles[k] for k in names}
    many = typical_layers(profiles, dict.fromkeys(names, 10), L70.num_layers)
    # Helix's artifact: A100 8, L4x2 9, T4 3, T4x2 6, T4x4 12, V100 3 (and L4 4, where this rule says 5).
    assert many == {"a100": 8, "2xl4": 9, "t4": 3, "2xt4": 6, "4xt4": 12, "v100": 3}
    few = typical_layers(profiles, dict.fromkeys(names, 1) | {"a100": 1}, L70.num_layers)
    assert few == {k: p.max_layers for k, p in profiles.items()}  # no room to spare: every node full


def test_given_throughputs_and_unused_profiles_are_kept() -> None:
    table = helix_profile_table(L70)
    given = replace(table.profiles["l4"], throughput=(1.0,) * 7, throughput_given=True)
    out = pipeline_throughputs({"a100": table.profiles["a100"], "l4": given, "t4": table.profiles["t4"]},
                               {"a100": 4, "l4": 4}, L70, W)
    assert out["l4"] is given and out["t4"] is table.profiles["t4"]
    assert out["a100"].throughput != table.profiles["a100"].throughput


def test_profile_table_for_in_pipeline() -> None:
    cluster = ClusterSpec(name="two", nodes=(NodeSpec("a", "a100", "r", 40.0), NodeSpec("b", "l4", "r", 24.0),
                                             NodeSpec("c", "l4", "r", 24.0)), coordinator_region="r")
    alone = profile_table_for(cluster, L70, "helix")
    inside = profile_table_for(cluster, L70, "helix", in_pipeline=True)
    assert inside.profiles == in_pipelines(alone, cluster, L70).profiles
    for k in ("a100", "l4"):
        assert alone.profiles[k].throughput == throughputs(alone.profiles[k], L70, W)
        assert all(i <= a * (1 + 1e-9) for i, a in zip(inside.profiles[k].throughput, alone.profiles[k].throughput,
                                                        strict=True))
    # The KV share in use scales the decode batch: a fuller KV never serves less.
    fuller = profile_table_for(cluster, L70, "helix", workload=Workload(kv_fill=1.0), in_pipeline=True)
    emptier = profile_table_for(cluster, L70, "helix", workload=Workload(kv_fill=0.3), in_pipeline=True)
    assert all(f >= e for f, e in zip(fuller.profiles["l4"].throughput, emptier.profiles["l4"].throughput,
                                      strict=True))
    roof = profile_table_for(uniform_cluster(3, "l4"), L70, "roofline", in_pipeline=True)
    assert roof.profiles["l4"].throughput[0] > 0


@pytest.mark.parametrize("bad", [{"kv_fill": 0.0}, {"kv_fill": 1.5}, {"input_len": 0}, {"max_batch": 0}])
def test_a_bad_workload_says_what_is_wrong(bad: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="bad workload"):
        Workload(**bad)  # type: ignore[arg-type]
