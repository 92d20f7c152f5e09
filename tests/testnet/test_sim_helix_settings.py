"""`--like helix`: named settings only (the same as passing them), Helix's offline loop, the output estimate."""

from __future__ import annotations

import json
import random
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from hetnode.cli import main
from hetnode.coordinator.scheduler import OutputLength
from hetnode.errors import ConfigError
from hetnode.planner.cluster import load_cluster
from hetnode.planner.model import model_spec
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.profile_sources import profile_table_for
from hetnode.testnet.sim import SimOptions, Trace, Workload, load_trace, offline, sampled, simulate
from hetnode.testnet.sim.offline_loop import OfflineLoop
from hetnode.testnet.sim.settings import like, options_like

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "hetnode" / "testnet" / "clusters" / "helix-single.toml"
# Helix's ILP placement for helix-single (the data folder's plan), enough of it to run: one pipeline.
PIPELINE = [("t4-7", 0, 3), ("l4-4", 3, 7), ("l4-0", 7, 11), ("t4-8", 11, 14), ("a100-3", 14, 23),
            ("l4-7", 23, 30), ("a100-1", 30, 42), ("l4-3", 42, 49), ("t4-11", 49, 53), ("l4-1", 53, 60),
            ("a100-2", 60, 68), ("a100-0", 68, 77), ("t4-2", 77, 80)]


def _plan() -> PlacementPlan:
    names = [n for n, _, _ in PIPELINE]
    flows = ([{"from": "source", "to": names[0], "flow": 100.0}]
             + [{"from": a, "to": b, "flow": 100.0} for a, b in pairwise(names)]
             + [{"from": names[-1], "to": "sink", "flow": 100.0}])
    return PlacementPlan.from_json({
        "cluster": "helix-single", "model": "llama-70b", "num_layers": 80, "method": "helix", "max_flow": 100.0,
        "placements": [{"node": n, "first_layer": a, "last_layer": b} for n, a, b in PIPELINE], "flows": flows})


def _run(options: SimOptions) -> dict[str, object]:
    cluster = load_cluster(CLUSTER)
    model = model_spec("llama-70b")
    result = simulate(cluster, model, profile_table_for(cluster, model, "helix"), _plan(),
                      workload=offline(load_trace("conv")), duration_s=40.0, warmup_s=5.0, options=options)
    summary: dict[str, object] = result.summary
    return summary


def test_like_helix_is_exactly_its_named_settings() -> None:
    explicit = SimOptions(kv_pool="measured", past_table="line", step_caps=True, max_batch_tokens=1 << 30,
                          link_messages="item", decode_loop="coordinator", swarm_wiring="link",
                          solo_decode_factor=2.0, first_layer_copy_s=7.4e-6, output_len=240.0, learn_output=False,
                          high_water=0.85, output_ratio=1.0,
                          offline_loop=OfflineLoop(start=20, kv_use=0.8, every="prompt_or_end", measure="layer",
                                                   lengths="drawn", delay_s=0.1))
    assert options_like("helix", offline=True) == explicit
    # The same run either way, and not the default's.
    assert _run(options_like("helix", offline=True)) == _run(explicit)
    assert _run(options_like("helix", offline=True)) != _run(SimOptions())


def test_helix_online_marks_and_overrides() -> None:
    online = like("helix", offline=False)
    assert (online["high_water"], online["output_ratio"]) == (0.9, 0.6) and "offline_loop" not in online
    assert options_like("helix", offline=False, link_messages="step").link_messages == "step"
    assert options_like("hetnode", offline=True) == SimOptions()


def test_helix_gives_a_node_past_its_measured_layers_the_tables_line() -> None:
    # The separate pipelines' A100 replica of LLaMA-2 70B: 20 layers a node, 8 more than vLLM's table has.
    names = [f"a100-{i}" for i in range(4)]
    flows = ([{"from": "source", "to": names[0], "flow": 100.0}]
             + [{"from": a, "to": b, "flow": 100.0} for a, b in pairwise(names)]
             + [{"from": names[-1], "to": "sink", "flow": 100.0}])
    plan = PlacementPlan.from_json({
        "cluster": "helix-single", "model": "llama-70b", "num_layers": 80, "method": "sp", "max_flow": 100.0,
        "placements": [{"node": n, "first_layer": 20 * i, "last_layer": 20 * (i + 1)} for i, n in enumerate(names)],
        "flows": flows})
    cluster, model = load_cluster(CLUSTER), model_spec("llama-70b")
    profiles = profile_table_for(cluster, model, "helix", kv_share=0.15)

    def blocks(options: SimOptions) -> set[int]:
        result = simulate(cluster, model, profiles, plan, workload=offline(load_trace("conv")), duration_s=5.0,
                          warmup_s=1.0, options=options)
        return {n.kv_capacity_blocks for n in result.nodes if n.layers}

    assert blocks(options_like("helix", offline=True)) == {1755 // 16}
    assert blocks(options_like("helix", offline=True, past_table="estimate")) == {106_496 // 16}
    with pytest.raises(ConfigError, match="past_table"):
        SimOptions(past_table="extrapolate")


def test_an_unknown_setting_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"unknown simulator setting 'vllm'.*hetnode, helix"):
        like("vllm", offline=True)


# -- Helix's offline loop --------------------------------------------------------------------------------------


def test_offline_loop_admission_by_token_adds_one_per_completion() -> None:
    loop = OfflineLoop(start=20, kv_use=0.8, every="token")
    assert loop.admits(0.5, 0) and not loop.admits(0.5, 1)  # one per token
    assert loop.admits(0.8, 0) and not loop.admits(0.81, 0)  # "at or under 0.8"
    by_finish = OfflineLoop(every="finish")
    assert by_finish.admits(0.5, 7) and not by_finish.admits(0.9, 0)


def test_offline_loop_measures_the_fullest_node_or_the_total() -> None:
    nodes = [(80.0, 100), (10.0, 100), (5.0, None)]  # an unlimited node does not count
    assert OfflineLoop(measure="max").use(nodes) == pytest.approx(0.8)
    assert OfflineLoop(measure="total").use(nodes) == pytest.approx(0.45)
    assert OfflineLoop(measure="max").use([]) == 0.0


def test_offline_loop_measures_the_fullest_layer_over_the_nodes_holding_it() -> None:
    # Helix's bottleneck_usage: layer 0 is held by two nodes (80 + 10 of 200), layers 1-2 by one (30 of 50).
    nodes = [(80.0, 100), (10.0, 100), (30.0, 50), (5.0, None)]
    layers = [(0, 1), (0, 1), (1, 3), (1, 3)]
    assert OfflineLoop(measure="layer").use(nodes, layers) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="layer range"):
        OfflineLoop(measure="layer").use(nodes)


def test_offline_loop_prompt_or_end_adds_one_at_a_prompt_end_or_a_request_end() -> None:
    loop = OfflineLoop(every="prompt_or_end")
    assert loop.on_prompt and not OfflineLoop(every="token").on_prompt and not OfflineLoop(every="finish").on_prompt
    assert loop.admits(0.5, 0) and not loop.admits(0.5, 1) and not loop.admits(0.9, 0)


def test_prompt_or_end_adds_fewer_requests_than_every_token() -> None:
    # The same run: every token a chance to add one request, or only each prompt's end and each request's end.
    by_token = _run(options_like("helix", offline=True, offline_loop=OfflineLoop(every="token")))
    by_prompt = _run(options_like("helix", offline=True))  # Helix's: prompt_or_end
    arrived = [r["requests"]["arrived"] for r in (by_token, by_prompt)]  # type: ignore[index]
    assert 20 < arrived[1] < arrived[0]
    assert by_prompt["requests"]["still_queued"] == 0  # type: ignore[index]


@pytest.mark.parametrize("bad", [{"start": 0}, {"kv_use": 0.0}, {"kv_use": 1.5}, {"every": "step"},
                                 {"measure": "mean"}, {"lengths": "shuffled"}, {"delay_s": -0.1}])
def test_offline_loop_refuses_bad_settings(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        OfflineLoop(**bad)  # type: ignore[arg-type]


def test_offline_loop_takes_requests_in_order_or_draws_them_as_helixs_sampler() -> None:
    rng = random.Random(5)
    assert [OfflineLoop().index(i, 3, rng) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    drawn, rng = OfflineLoop(lengths="drawn"), random.Random(5)
    helix = random.Random(5)  # Helix's LengthSampler: random.seed(seed), then randint(0, n - 1) per request
    assert [drawn.index(i, 1000, rng) for i in range(50)] == [helix.randint(0, 999) for _ in range(50)]


def _started_inputs(lengths: str, seed: int) -> list[int]:
    # Distinct input lengths, so each started request names the workload entry it took.
    wl = Workload(name="distinct", inputs=tuple(range(100, 140)), outputs=(6,) * 40, offline=True)
    cluster = load_cluster(CLUSTER)
    model = model_spec("llama-70b")
    options = options_like("helix", offline=True, offline_loop=OfflineLoop(lengths=lengths))
    result = simulate(cluster, model, profile_table_for(cluster, model, "helix"), _plan(), workload=wl,
                      duration_s=20.0, warmup_s=1.0, seed=seed, options=options)
    return [r.input_len for r in sorted(result.requests, key=lambda r: int(r.id[1:]))]


def test_the_helix_loop_runs_the_workload_in_order_or_drawn_with_the_runs_seed() -> None:
    in_order = _started_inputs("order", seed=3)
    assert len(in_order) > 40 and in_order == [100 + i % 40 for i in range(len(in_order))]
    drawn = _started_inputs("drawn", seed=3)
    rng = random.Random(3)
    assert len(drawn) > 20 and drawn == [100 + rng.randrange(40) for _ in drawn]
    assert drawn != in_order[:len(drawn)]


def _arrivals(delay_s: float) -> list[Any]:
    wl = Workload(name="short", inputs=tuple(range(100, 140)), outputs=(6,) * 40, offline=True)
    cluster = load_cluster(CLUSTER)
    model = model_spec("llama-70b")
    options = options_like("helix", offline=True, offline_loop=OfflineLoop(delay_s=delay_s))
    result = simulate(cluster, model, profile_table_for(cluster, model, "helix"), _plan(), workload=wl,
                      duration_s=20.0, warmup_s=1.0, options=options)
    return sorted(result.requests, key=lambda r: int(r.id[1:]))


def test_the_helix_loop_starts_its_requests_a_delay_after_what_adds_them() -> None:
    at_once = _arrivals(0.0)
    assert [r.arrival for r in at_once[:20]] == [0.0] * 20
    later = _arrivals(0.1)
    assert len(later) > 30
    # Helix's feeder: the first ones 0.1 s apart, each later one 0.1 s after a prompt's end or a request's end.
    assert [r.arrival for r in later[:20]] == pytest.approx([0.1 * k for k in range(20)])
    events = [t for r in later for t in (r.first_token, r.finish) if t == t]  # NaN: not reached
    for r in later[20:]:
        assert min(abs(r.arrival - 0.1 - t) for t in events) < 1e-9


def test_a_delayed_loop_adds_one_request_per_event_even_when_every_finish_may_add_many() -> None:
    options = options_like("helix", offline=True, offline_loop=OfflineLoop(every="finish", delay_s=0.1))
    requests = _run(options)["requests"]
    assert isinstance(requests, dict) and requests["arrived"] > 20


def test_helix_offline_loop_keeps_the_estimate_under_its_bound_and_queues_nothing() -> None:
    summary = _run(options_like("helix", offline=True))
    requests = summary["requests"]
    assert isinstance(requests, dict)
    assert requests["still_queued"] == 0 and requests["arrived"] > 20


def test_the_fixed_count_loop_adds_one_per_end_whatever_the_estimate() -> None:
    loop = OfflineLoop(start=240, every="replace")
    assert not loop.bounded and not loop.on_prompt and OfflineLoop().bounded
    assert loop.admits(5.0, 0) and not loop.admits(0.0, 1)  # the estimate does not count, one per end


def _fixed(inflight: int | None, inputs: tuple[int, ...], **more: Any) -> Any:
    wl = Workload(name="short", inputs=inputs, outputs=(6,) * len(inputs), offline=True)
    cluster, model = load_cluster(CLUSTER), model_spec("llama-70b")
    return simulate(cluster, model, profile_table_for(cluster, model, "helix"), _plan(), workload=wl,
                    duration_s=20.0, warmup_s=1.0, options=options_like("helix", offline=True, inflight=inflight,
                                                                         **more))


def _in_flight(records: list[Any], t: float) -> int:
    return sum(1 for r in records if not r.rejected and r.arrival <= t and not r.finish <= t)


def test_helix_fixed_count_keeps_that_many_in_flight_each_end_replaced() -> None:
    result = _fixed(7, tuple(range(100, 140)))
    records = sorted(result.requests, key=lambda r: r.arrival)
    finished = [r.finish for r in records if r.finish == r.finish]
    assert len(finished) > 20
    # Helix's feeder: the count at once (0.1 s apart), then one 0.1 s after each request's end, never more.
    assert max(_in_flight(records, r.arrival) for r in records) == 7
    later = [r.arrival for r in records[7:]]
    assert later == pytest.approx([t + 0.1 for t in sorted(finished) if t + 0.1 < 20.0][:len(later)])
    assert len(later) == sum(1 for t in finished if t + 0.1 < 20.0)


def test_helix_fixed_count_is_not_bounded_by_the_kv_estimate() -> None:
    # The KV-bounded loop stops adding at the estimate's bound; a hand-set count goes past it, and the scheduler
    # queues what its mask does not let through.
    inputs = tuple(range(1500, 1700))
    bounded, fixed = _fixed(None, inputs), _fixed(150, inputs)
    most = [max(_in_flight(r.requests, x.arrival) for x in r.requests) for r in (bounded, fixed)]
    assert most[0] < 150 == most[1]
    assert fixed.summary["requests"]["still_queued"] > 0 == bounded.summary["requests"]["still_queued"]


def test_helix_fixed_count_replaces_a_request_the_scheduler_refuses() -> None:
    # Pools of 2,000 tokens: the 3,000-token prompts can never fit and are refused; others take their places.
    names = [n for n, _, _ in PIPELINE]
    result = _fixed(5, (3000, 100, 110, 3000, 120, 130, 3000, 140), kv_capacity={n: 2000 for n in names})
    refused = [r for r in result.requests if r.rejected]
    assert refused and all(r.input_len == 3000 for r in refused)
    starts = sorted(r.arrival for r in result.requests if not r.rejected)
    assert len(starts) > 5 and max(_in_flight(result.requests, t) for t in starts) == 5


def test_a_hand_set_count_in_flight_is_a_helix_setting() -> None:
    assert like("helix", offline=True, inflight=240)["offline_loop"] == OfflineLoop(
        start=240, kv_use=0.8, every="replace", measure="layer", lengths="drawn", delay_s=0.1)
    assert "offline_loop" not in like("helix", offline=False, inflight=240)
    with pytest.raises(ConfigError, match="Helix's feeder"):
        like("hetnode", offline=True, inflight=240)


# -- Helix's online generator ----------------------------------------------------------------------------------


def test_sampled_draws_interval_rates_and_lengths_from_the_trace() -> None:
    # Two 3 s bins: one request, then three; scaled to 1 req/s each interval carries 1.5 x its bin's count.
    trace = Trace("t", timestamps=(0.0, 3.5, 4.0, 5.0), inputs=(10, 20, 30, 40), outputs=(1, 2, 3, 4))
    w = sampled(trace, rate=1.0, duration_s=300.0, seed=1)
    assert w == sampled(trace, rate=1.0, duration_s=300.0, seed=1)  # seeded
    assert w != sampled(trace, rate=1.0, duration_s=300.0, seed=2)
    assert len(w) == pytest.approx(300, rel=0.15)  # the rate on average (a random mix of 1.5 and 4.5 per 3 s)
    assert all(0 <= a < 300 for a in w.arrivals) and list(w.arrivals) == sorted(w.arrivals)
    pairs = set(zip(w.inputs, w.outputs, strict=True))
    assert pairs == {(10, 1), (20, 2), (30, 3), (40, 4)}  # every pair of the trace, drawn at random
    counts = [sum(1 for a in w.arrivals if 3 * k <= a < 3 * k + 3) for k in range(100)]
    assert set(counts) <= {1, 2, 4, 5}  # 1.5 or 4.5 rounded, the rest carried to the next interval
    with pytest.raises(ConfigError):
        sampled(trace, rate=0.0, duration_s=10.0)


# -- the scheduler's output estimate ---------------------------------------------------------------------------


def test_output_estimate_ratio_and_fixed_length() -> None:
    learned = OutputLength(240.0, ratio=0.6)
    assert learned.mean == pytest.approx(144.0)
    learned.add(40.0)
    assert learned.mean < 144.0  # learns
    fixed = OutputLength(240.0, ratio=0.6, learn=False)
    fixed.add(40.0)
    assert fixed.mean == pytest.approx(144.0)
    with pytest.raises(ValueError):
        OutputLength(240.0, ratio=0.0)


# -- the command line ------------------------------------------------------------------------------------------


def test_cli_like_helix_runs_and_reports_helix_latencies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_plan().to_json()))
    code = main(["sim", "--cluster", str(CLUSTER), "--model", "llama-70b", "--profile", "helix", "--plan", str(plan),
                 "--offline", "--duration", "30", "--warmup", "5", "--like", "helix", "--progress", "off", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["option_kv_pool"] == "measured" and out["config"]["option_high_water"] == 0.85
    assert "Helix's loop" in out["config"]["workload_description"]
    assert out["summary"]["helix_latency"]["decode_step"]["count"] > 0


def test_cli_unknown_like_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["sim", "--cluster", str(CLUSTER), "--model", "llama-70b", "--like", "vllm"])
    assert info.value.code == 2
    assert "invalid choice: 'vllm'" in capsys.readouterr().err
