"""`hetnode sim`: JSON that parses, CSV and PNG files written, configuration mistakes exit 2."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hetnode.cli import main
from hetnode.planner.plan import SINK, SOURCE, NodePlacement, PlacementPlan

CLUSTER = """
name = "pair"
[[nodes]]
name = "a"
device = "a100"
region = "us"
[[nodes]]
name = "b"
device = "a100"
region = "us"
[links.default]
bandwidth_mbps = 10000
latency_ms = 1
"""


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    cluster = tmp_path / "pair.toml"
    cluster.write_text(CLUSTER)
    plan = PlacementPlan(cluster="pair", model="llama3-8b", num_layers=32, method="given",
                         placements=(NodePlacement("a", 0, 16), NodePlacement("b", 16, 32)),
                         flows={(SOURCE, "a"): 500.0, ("a", "b"): 500.0, ("b", SINK): 500.0}, max_flow=500.0)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json()))
    return cluster, path


def test_sim_json_csv_and_plots(setup: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster, plan = setup
    plots, csvs = tmp_path / "plots", tmp_path / "csv"
    code = main(["sim", "--cluster", str(cluster), "--model", "llama3-8b", "--profile", "roofline", "--plan", str(plan),
                 "--trace", "conv", "--rate", "0.5", "--duration", "40", "--warmup", "5", "--slo-ttft", "5",
                 "--json", "--requests", "--plots", str(plots), "--csv", str(csvs), "--progress", "off"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["cluster"] == "pair" and out["config"]["scheduler"] == "iwrr"
    assert out["config"]["rate"] == pytest.approx(0.5, rel=0.05)
    s = out["summary"]
    assert s["requests"]["arrived"] == 20 and s["decode_throughput"] > 0
    assert set(s["slo_attainment"]) == {"ttft", "all"}
    assert {n["name"] for n in out["nodes"]} == {"a", "b"}
    assert len(out["requests"]) == 20
    for name in ("latency_cdf", "throughput", "node_utilization", "node_utilization_time", "links"):
        png = plots / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in csvs.iterdir()) == ["links.csv", "nodes.csv", "requests.csv", "timeseries.csv"]
    assert len((csvs / "requests.csv").read_text().splitlines()) == 21


def test_sim_table_and_offline(setup: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cluster, plan = setup
    code = main(["sim", "--cluster", str(cluster), "--model", "llama3-8b", "--profile", "roofline", "--plan", str(plan),
                 "--offline", "--duration", "20", "--warmup", "5", "--scheduler", "random", "--progress", "off"])
    assert code == 0
    out = capsys.readouterr().out
    assert "decode" in out and "offline" in out and "random" in out


def test_sim_configuration_mistakes_exit_2(setup: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cluster, plan = setup
    assert main(["sim", "--cluster", "no-such-cluster", "--model", "llama3-8b", "--plan", str(plan)]) == 2
    assert "no such cluster" in capsys.readouterr().err
    assert main(["sim", "--cluster", str(cluster), "--model", "llama3-8b", "--profile", "roofline",
                 "--plan", str(plan), "--trace", "nothing.csv"]) == 2
    assert main(["sim", "--cluster", str(cluster), "--model", "llama3-8b", "--profile", "roofline",
                 "--plan", str(plan), "--duration", "10", "--warmup", "20"]) == 2


def test_sim_arrivals_from_helix_generator(setup: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    cluster, plan = setup
    args = ["sim", "--cluster", str(cluster), "--model", "llama3-8b", "--profile", "roofline", "--plan", str(plan),
            "--trace", "conv", "--rate", "0.5", "--duration", "120", "--warmup", "5", "--json", "--progress", "off"]
    assert main([*args, "--sampled", "--seed", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    config = out["config"]
    assert config["workload"].endswith("-sampled") and "Helix's generator" in config["workload_description"]
    assert config["rate"] == pytest.approx(0.5, rel=0.25)  # 3 s bins of the trace's rate, drawn at random
    with pytest.raises(SystemExit) as exit_:  # one way of drawing arrivals: a usage error
        main([*args, "--sampled", "--poisson"])
    assert exit_.value.code == 2
    assert "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize("peak", ["measured", "maxflow"])
def test_sim_online_rate_from_the_peak(setup: tuple[Path, Path], peak: str, capsys: pytest.CaptureFixture[str]) -> None:
    cluster, plan = setup
    code = main(["sim", "--cluster", str(cluster), "--model", "llama3-8b", "--profile", "roofline", "--plan", str(plan),
                 "--duration", "30", "--warmup", "5", "--peak", peak, "--json", "--progress", "off"])
    assert code == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert "peak:" in captured.err and out["config"]["rate"] > 0
    if peak == "maxflow":  # 75% of 500 tokens/s in requests of the trace's mean length
        assert "max flow" in captured.err


def test_sim_plans_with_the_runtime_planner(setup: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import hetnode.planner.placement as placement

    calls: list[str] = []
    real = placement.plan_placement

    def spy(*args: Any, **kwargs: Any) -> PlacementPlan:
        calls.append(kwargs["method"])
        plan: PlacementPlan = real(*args, **kwargs)
        return plan

    monkeypatch.setattr(placement, "plan_placement", spy)
    cluster, _ = setup
    code = main(["sim", "--cluster", str(cluster), "--model", "llama3-8b", "--profile", "roofline", "--method",
                 "petals", "--rate", "0.5", "--duration", "20", "--warmup", "2", "--json", "--progress", "off"])
    assert code == 0 and calls == ["petals"]
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["method"] == "petals" and out["summary"]["requests"]["arrived"] == 10


SPLIT_CLUSTER = """
name = "quad"
[[nodes]]
name = "a"
device = "a100"
region = "us"
[[nodes]]
name = "b"
device = "a100"
region = "us"
[[nodes]]
name = "c"
device = "l4"
region = "us"
[[nodes]]
name = "d"
device = "l4"
region = "us"
[links.default]
bandwidth_mbps = 1000
latency_ms = 2
"""


@pytest.mark.parametrize("flag", ["--method", "--placement"])
def test_sim_split_plans_routes_by_cls_and_reports_the_hand_offs(flag: str, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "quad.toml"
    cluster.write_text(SPLIT_CLUSTER)
    args = ["sim", "--cluster", str(cluster), "--model", "llama3-8b", "--profile", "roofline", flag, "split",
            "--trace", "conv", "--rate", "0.5", "--duration", "30", "--warmup", "5", "--progress", "off"]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["method"] == "split" and out["config"]["scheduler"] == "cls"
    kv = out["summary"]["kv_handoff"]
    assert kv["installs"] >= out["summary"]["requests"]["finished"] > 0
    assert sum(kv["bytes_by_codec"].values()) > 0
    assert kv["prefill_end_to_decode_s"]["mean"] > 0
    assert main([*args, "--kv-transfer", "whole", "--kv-codec", "int8"]) == 0
    text = capsys.readouterr().out
    assert "scheduler    cls" in text and "KV hand-off  int8 " in text and "whole" in text
    assert "prefill end -> first decode step: mean" in text


def test_sim_books_the_decode_kv_at_the_handoff_when_asked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "quad.toml"
    cluster.write_text(SPLIT_CLUSTER)
    args = ["sim", "--cluster", str(cluster), "--model", "llama3-8b", "--profile", "roofline", "--placement", "split",
            "--trace", "conv", "--rate", "0.5", "--duration", "30", "--warmup", "5", "--progress", "off", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["option_decode_booking"] == "admission"  # the default: the runtime's
    assert out["summary"]["kv_handoff"]["handoffs_booked"] == 0
    assert main([*args, "--decode-booking", "handoff"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["option_decode_booking"] == "handoff"
    kv = out["summary"]["kv_handoff"]
    assert kv["handoffs_booked"] >= out["summary"]["requests"]["finished"] > 0 and kv["refused_full"] == 0
    assert main([*args, "--decode-booking", "handoff", "--scheduler", "splitwise"]) == 2  # Splitwise books at admission
    assert "decode_booking" in capsys.readouterr().err


def test_sim_routes_a_split_plan_by_splitwise_pools_when_asked(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    cluster = tmp_path / "quad.toml"
    cluster.write_text(SPLIT_CLUSTER)
    args = ["sim", "--cluster", str(cluster), "--model", "llama3-8b", "--profile", "roofline", "--placement", "split",
            "--scheduler", "splitwise", "--trace", "conv", "--rate", "2", "--duration", "30", "--warmup", "5",
            "--progress", "off", "--json"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["scheduler"] == "splitwise"
    assert out["summary"]["requests"]["finished"] > 0


@pytest.mark.parametrize(("given", "cap"), [([], 1024), (["--prefill-tokens", "0"], None)])
def test_sim_plans_and_routes_thunderserve_as_the_coordinator_does(capsys: pytest.CaptureFixture[str],
                                                                   given: list[str], cap: int | None) -> None:
    """`hetnode sim --placement thunderserve`: ThunderServe's plan over the cloud cluster's GPUs, routed by its
    orchestration (tstp), KV handed from its prefill replicas to its decode ones, whose prompt-token cap is the
    coordinator's default for the placement unless told otherwise."""
    code = main(["sim", "--cluster", "thunderserve-cloud", "--model", "llama-30b", "--placement", "thunderserve",
                 "--trace", "code", "--rate", "1", "--duration", "20", "--warmup", "2", "--json", "--progress", "off",
                 *given])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    c, s = out["config"], out["summary"]
    assert c["method"] == "thunderserve" and c["scheduler"] == "tstp" and "prefill" in c["plan_size"]
    assert c["option_prefill_tokens"] == cap
    assert s["requests"]["finished"] > 0 and s["kv_handoff"]["installs"] > 0


def test_sim_loses_gpus_and_reschedules_as_told(capsys: pytest.CaptureFixture[str]) -> None:
    """`--lose NODES@T` and `--reschedule`: the run reports the loss, the re-plan and attainment before and after;
    mistakes (an unknown node, a time outside the run, a lightweight re-plan of a plan that has none, a
    --reschedule without a loss) exit 2 with the reason."""
    base = ["sim", "--cluster", "thunderserve-cloud-gpus", "--model", "llama-30b", "--placement", "thunderserve",
            "--trace", "code", "--rate", "1", "--duration", "40", "--warmup", "0", "--slo-e2e", "30",
            "--progress", "off"]
    host = ",".join(f"4xa6000-1-gpu{k}" for k in range(4))
    assert main([*base, "--lose", f"{host}@15", "--reschedule-delay", "1", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["summary"]
    kinds = [e["event"] for e in s["replan"]]
    assert kinds == ["loss", "replan", "ready"] and s["replan"][1]["how"] == "lightweight"
    assert s["replan"][1]["at"] == pytest.approx(16.0)
    windows = s["slo_windows"]
    assert [w["from"] for w in windows][:2] == [0.0, 15.0] and all("e2e" in w for w in windows if w["requests"])
    assert main([*base, "--lose", f"{host}@15", "--reschedule", "none"]) == 0
    out = capsys.readouterr().out
    assert "re-plan      15 s: lost 4xa6000-1-gpu0" in out and "arrived [0, 15) s" in out
    for wrong, says in ((["--lose", "nope@5"], "has no node nope"), (["--lose", f"{host}@40"], "outside the run"),
                        (["--lose", "4xa6000-1-gpu0"], "NODE[,NODE...]@SECONDS"),
                        (["--reschedule", "full"], "give --lose")):
        assert main([*base, *wrong]) == 2
        assert says in capsys.readouterr().err
    assert main(["sim", "--cluster", "thunderserve-cloud", "--model", "llama-30b", "--placement", "sp", "--profile",
                 "roofline", "--trace", "code", "--rate", "1", "--duration", "20", "--warmup", "2",
                 "--lose", "4xa6000-0@5", "--reschedule", "lightweight", "--progress", "off"]) == 2
    assert "lightweight rescheduling is ThunderServe's" in capsys.readouterr().err


def test_sim_plans_thunderserve_for_the_decode_booking_it_runs() -> None:
    # The planner prices a decode replica's KV over the time the run's booking holds it (slo.decode_residency).
    import argparse
    from types import SimpleNamespace

    from hetnode.testnet.sim.cli import _thunderserve_options

    trace = SimpleNamespace(inputs=[1155], outputs=[211])
    for booking in ("admission", "handoff"):
        args = argparse.Namespace(rate=None, seed=0, decode_booking=booking)
        assert _thunderserve_options(args, trace, 0.1).decode_booking == booking
