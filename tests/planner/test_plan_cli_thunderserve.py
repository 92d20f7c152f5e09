"""`hetnode plan --method thunderserve`: the table with replicas, X and Y; JSON that validates and reads back as
a plan; the picture; and bad input as exit 2 with a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetnode.cli import main
from hetnode.planner.plan import PlacementPlan

BASE = ["--cluster", "thunderserve-cloud-gpus", "--model", "llama-30b", "--method", "thunderserve", "--steps", "5"]

ONE_GPU = """
name = "one-gpu"
[[nodes]]
name = "a6000-0"
device = "a6000"
region = "r"
host = "h0"
[links.default]
bandwidth_mbps = 5000
latency_ms = 1
"""


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_table_shows_replicas_routing_and_the_estimate(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    svg = tmp_path / "ts.svg"
    code, out, err = run(capsys, *BASE, "--traffic", "code", "--rate", "3", "--picture", str(svg))
    assert code == 0, err
    assert out.startswith("Plan for llama-30b on thunderserve-cloud-gpus: method thunderserve")
    assert "replica  role     (tp,pp)" in out
    assert " prefill " in out and " decode " in out
    assert "Y (rows: prefill replicas, columns: decode replicas)" in out
    assert "estimated SLO attainment" in out
    assert "at 3 requests/s of 2048 in, 28 out" in out  # the code trace's means, at the rate given
    assert f"picture      {svg}" in out
    assert svg.read_text().startswith("<svg")


def test_json_validates_reads_back_and_is_the_same_under_a_seed(capsys: pytest.CaptureFixture[str]) -> None:
    runs = []
    for _ in range(2):
        code, out, err = run(capsys, *BASE, "--traffic", "1000,100", "--seed", "2", "--json")
        assert code == 0, err
        runs.append(json.loads(out))
    data = runs[0]
    assert data["validation"] == []
    assert data["method"] == "thunderserve" and data["profiles"].startswith("roofline")
    roles = [r["role"] for r in data["replicas"]]
    assert set(roles) == {"prefill", "decode"}
    plan = PlacementPlan.from_json(data)
    assert plan.orchestration is not None
    assert sum(plan.orchestration.prefill_share) == pytest.approx(1.0)
    assert len(plan.orchestration.prefill_share) == roles.count("prefill")
    assert all(sum(row) == pytest.approx(1.0) for row in plan.orchestration.decode_share)
    nodes = [n for r in plan.replicas for n in r.nodes]
    assert len(nodes) == len(set(nodes)) <= 32
    assert runs[0] | {"solve_time_s": 0} == runs[1] | {"solve_time_s": 0}


@pytest.mark.parametrize(("args", "text"), [
    (["--steps", "-1"], "bad ThunderServe options: steps >= 0"),
    (["--traffic", "abc"], "--traffic: expected IN,OUT (two integers), not 'abc'"),
    (["--traffic", "0,5"], "--traffic: needs at least 1 prompt and 0 output tokens"),
    (["--picture", "plan.gif"], "a picture is .svg or .png"),
])
def test_bad_options_exit_2_with_the_reason(capsys: pytest.CaptureFixture[str], args: list[str], text: str) -> None:
    code, out, err = run(capsys, *BASE, *args)
    assert code == 2 and out == ""
    assert text in err


def test_a_cluster_too_small_for_two_replicas(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "one.toml"
    path.write_text(ONE_GPU)
    code, out, err = run(capsys, "--cluster", str(path), "--model", "llama-30b", "--method", "thunderserve")
    assert code == 2 and out == ""
    assert "cannot hold llama-30b in two groups of GPUs" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in (["--rate", "0"], ["--slo-scale", "-1"], ["--steps", "many"]):
        with pytest.raises(SystemExit) as info:
            main(["plan", *BASE, *bad])
        assert info.value.code == 2
    capsys.readouterr()
