"""Smoke runs of the benchmark scripts: they start, measure every side and report well-formed results.

Only the mechanics are checked (every cell measured, greedy texts identical across sides); the performance
targets are for the full runs on a quiet machine, not for a shared CI runner.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.alone
def test_bench_e2e_quick() -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "bench_e2e.py"), "--quick", "--json"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout)

    engine = result["engine"]
    for batch in (1, 8):
        cell = engine[f"batch{batch}"]
        assert cell["ours_tok_s"] > 0 and cell["transformers_tok_s"] > 0 and cell["ratio"] > 0

    serving = result["serving"]
    assert set(serving["sides"]) == {"local_1t", f"local_{result['cores']}t", "testnet"}
    for side in serving["sides"].values():
        for batch in (1, 8):
            cell = side[f"batch{batch}"]
            assert cell["requests"] >= 1 and cell["completion_tokens"] > 0
            assert cell["decode_tok_s"] > 0 and cell["ttft_median_s"] > 0 and cell["cpu_ms_per_token"] > 0
    assert all(v > 0 for v in serving["ratios"].values())
    # Greedy: the network and the single process produce the same text for every prompt.
    for key, ident in serving["identical"].items():
        assert ident["prompts"] == 8 and not ident["differing"], (key, ident, serving["sample_texts"])


def test_bench_scheduler_quick() -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "bench_scheduler.py"), "--quick", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["nodes"] == 42 and result["flow_edges"] > 0 and result["kv_room_requests"] > 0
    assert set(result["scenarios"]) == {"light", "saturated"}
    for scenario in result["scenarios"].values():
        assert set(scenario["policies"]) == {"iwrr", "random", "shortest-queue", "swarm"}
        for cell in scenario["policies"].values():
            assert cell["decisions_s"] > 0 and cell["assigned"] > 0 and cell["mean_stages"] >= 1
    # Saturated: requests wait for KV room rather than being refused (the queue never fills).
    assert all(c["queued"] > 0 and c["rejected"] == 0 for c in result["scenarios"]["saturated"]["policies"].values())
    # The partially disaggregated designs' decisions, timed beside IWRR's.
    assert set(result["partial"]) == {"ecoserve-macro-8", "ecoserve-macro-16", "cronus-balancer",
                                      "cronus-balancer-scan"}
    assert all(cell["decisions_s"] > 0 for cell in result["partial"].values())


def test_bench_sim_quick() -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "bench_sim.py"), "--quick", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert result["nodes"] == 42 and result["plan_nodes"] > 0 and result["plan_max_flow"] > 0
    assert result["requests"] > 0 and result["finished"] > 0 and result["generated_tokens"] > 0
    assert result["events"] > 0 and result["wall_s"] > 0 and result["requests_per_wall_s"] > 0
    assert result["decode_throughput"] > 0 and 0 < result["node_utilization_mean"] <= 1


def test_bench_planner_quick() -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "bench_planner.py"), "--quick", "--json",
                        "--clusters", "helix-single", "helix-geo"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = json.loads(r.stdout)["rows"]
    assert [(row["cluster"], row["model"]) for row in rows] == [("helix-single", "llama-70b"),
                                                                 ("helix-geo", "llama-70b")]
    for row in rows:
        flows = row["flows"]
        assert row["valid"] and flows["petals"] > 0 and flows["swarm"] > 0
        assert flows["helix"] >= max(v for v in flows.values() if v is not None) * (1 - 1e-9)
        assert row["upper_bound"] >= flows["helix"] and 0 <= row["gap"] < 1
        assert row["paper_ratios"] is not None and row["helix_over_swarm"] >= 1


def test_reproduce_helix_quick(tmp_path: Path) -> None:
    out = tmp_path / "helix.json"
    # Half of --quick's simulated seconds: every run, plan and claim is still there (what this checks), in 48 s
    # instead of 68 s here (load 3); the claims' values, which nothing here asserts, are noisier.
    r = subprocess.run([sys.executable, str(SCRIPTS / "reproduce_helix.py"), "--quick", "--duration-scale", "0.5",
                        "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["settings"]["clusters"] == ["single"]
    # Every placement and scheduler of the single-cluster comparisons ran and served something.
    setups = {(s["setup"]["placement"], s["setup"]["scheduler"], s["setup"]["mode"]) for s in result["runs"]}
    assert {("helix", "iwrr", "offline"), ("helix", "iwrr", "online"), ("swarm", "swarm", "online"),
            ("sp", "iwrr", "online"), ("petals", "iwrr", "offline"), ("swarm", "iwrr", "offline"),
            ("helix", "random", "offline"), ("helix", "swarm", "offline")} <= setups
    assert all(run["decode_throughput"] > 0 for run in result["runs"])
    assert all(run["rate"] > 0 for run in result["runs"] if run["setup"]["mode"] == "online")
    assert all(plan["max_flow"] > 0 and not plan["validation"] for plan in result["plans"].values())
    # Every run says where its nodes' KV pools came from: §6.3's 70B separate pipelines from Helix's own files.
    pools = {(s["setup"]["model"], s["setup"]["placement"]): s["kv_pools"] for s in result["runs"]}
    assert pools[("70B", "sp")] == "Helix's single-cluster SP files"
    assert pools[("70B", "helix")] == pools[("30B", "sp")] == "vLLM's table, past it its line"
    # ... and how it ran, as Helix's artifact ran it: §6.7's random scheduling with 240 requests in flight, Swarm 180,
    # Helix's own scheduler its KV-bounded loop; the separate pipelines one simulation each.
    how = {(s["setup"]["model"], s["setup"]["placement"], s["setup"]["scheduler"], s["setup"]["mode"]): s["loop"]
           for s in result["runs"]}
    assert how[("70B", "helix", "random", "offline")] == "240 in flight"
    assert how[("70B", "swarm", "swarm", "offline")] == "180 in flight"
    assert how[("70B", "helix", "iwrr", "offline")] == "KV-bounded loop"
    assert how[("30B", "sp", "iwrr", "offline")].startswith("3 pipelines run apart (a100: random, 30 in flight")
    assert how[("30B", "sp", "iwrr", "online")].startswith("3 pipelines run apart")
    # §6.3, §6.6 and §6.7 single-cluster ratios, each judged against the paper's number.
    sections = {c["section"] for c in result["claims"]}
    assert sections == {"6.3", "6.6", "6.7"}
    assert result["summary"]["claims"] == len(result["claims"]) >= 20
    for claim in result["claims"]:
        assert isinstance(claim["same_winner"], bool)
        assert (claim["paper"] is None) == (claim["within_25pct"] is None)
    assert "same winner" in r.stdout and "within 25%" in r.stdout and "2.14x" in r.stdout


def test_bench_kv_quick() -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "bench_kv.py"), "--quick", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout)
    rows = result["codecs"]
    shapes: dict[str, set[str]] = {}
    for row in rows:
        shapes.setdefault(row["shape"], set()).add(row["codec"])
    # SmolLM2's KV (its shape from the GGUF) and one LLaMA-2 70B layer, each through every codec.
    assert len(shapes) == 2 and any("70B" in shape for shape in shapes)
    assert all(codecs == {"fp16", "bf16", "fp32", "int8", "int4", "int2"} for codecs in shapes.values())
    assert [30, 64, 3, 64] in [row["dims"] for row in rows]
    for row in rows:
        assert row["pack_gbps"] > 0 and row["unpack_gbps"] > 0 and row["bytes"] > 0
        # Sizes are arithmetic, not timing: int4 with its scales is 128/36 of fp16 at the default group.
        expected = {"fp16": 1, "bf16": 1, "fp32": 0.5, "int8": 128 / 68, "int4": 128 / 36,
                    "int2": 128 / 20}[row["codec"]]
        assert abs(row["ratio"] - expected) < 1e-9
    quality = result["quality"]
    assert set(quality) == {"unquantized", "fp16", "int8", "int4", "int2"}
    assert quality["unquantized"]["ppl_change_pct"] == 0 and quality["unquantized"]["greedy_agreement"] == 1
    for q in quality.values():
        settings = result["quality_settings"]
        assert q["ppl"] > 1 and q["scored_tokens"] == settings["continuation"] * settings["windows"]
        assert 0 <= q["top1_agreement"] <= 1 and 0 <= q["greedy_agreement"] <= 1
    # fp16 of a float32 cache changes the logits by rounding only.
    assert abs(quality["fp16"]["ppl_change_pct"]) < 0.1


def test_bench_kv_transfer_quick() -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "bench_kv.py"), "--quick", "--json", "--section", "transfer",
                        "--section", "threshold"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout)
    assert "codecs" not in result and result["link"]["mbps"] == 100 and result["link"]["layers"] == 30
    # Whole: one frame after the step; layer-wise: SmolLM2's 30 layers in the policy's 15 groups of 2.
    assert [row["tokens"] for row in result["transfer"]] == [64, 256]
    for row in result["transfer"]:
        whole, layerwise = row["whole"], row["layerwise"]
        assert whole["frames"] == 1 and layerwise["frames"] == 15
        assert whole["prefill_s"] > 0 and whole["exposed_s"] > 0 and layerwise["ready_s"] > layerwise["prefill_s"]
        assert row["hidden"] <= 1
    rows = result["threshold"]["rows"]
    assert [(row["tokens"], row["policy"]) for row in rows] == [(4, "whole"), (64, "layerwise")]
    assert all(row["streamed"] for row in rows) and result["threshold"]["policy_s"] == 0.02


def test_bench_planner_progress_quick() -> None:
    r = subprocess.run([sys.executable, str(SCRIPTS / "bench_planner.py"), "--progress", "--quick", "--json",
                        "--clusters", "helix-geo-pruned"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    runs = json.loads(r.stdout)["progress"]
    assert [(run["cluster"], run["partial"]) for run in runs] == [("helix-geo-pruned", True),
                                                                   ("helix-geo-pruned", False)]
    for run in runs:
        flows = [f for _, _, f in run["events"]]
        # The pruned coordinator reaches a few nodes; the search still starts from a heuristic that carries flow.
        assert run["valid"] and flows and flows[0] > 0 and flows == sorted(flows)
        assert flows[-1] <= run["max_flow"] + 1e-6 and run["max_flow"] <= run["upper_bound"] + 1e-6


@pytest.mark.alone
def test_chaos_quick() -> None:
    """A short chaos run: node kills, one coordinator restart; nothing hangs, nothing is silently wrong, no KV
    is left on any node (the script exits 1 otherwise)."""
    r = subprocess.run([sys.executable, str(SCRIPTS / "chaos.py"), "--minutes", "0.4", "--calm", "0.1", "--every",
                        "8", "--nodes", "2", "--clients", "2"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "coordinator restarted" in r.stdout and "killed and restarted" in r.stdout
    chaos = next(line for line in r.stdout.splitlines() if line.startswith("chaos:"))
    assert "'wrong': 0" in chaos and "'hung': 0" in chaos
    assert "KV after the run (coordinator /metrics): none held" in r.stdout


@pytest.mark.slow
def test_reproduce_splitwise_quick(tmp_path: Path) -> None:
    out = tmp_path / "splitwise.json"
    r = subprocess.run([sys.executable, str(SCRIPTS / "reproduce_splitwise.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    # Every design under both budgets it is judged in, on both traces, served something within the SLOs.
    designs = result["designs"]
    assert {k.split("/")[0] for k in designs} == {"power", "cost"}
    assert {k.split("/")[1] for k in designs} == {"code", "conv"}
    assert all(d["rate"] > 0 for d in designs.values())
    assert all(d["token"] == 0 for k, d in designs.items() if "Baseline" in k)
    assert all(d["token"] >= 1 for k, d in designs.items() if "Splitwise" in k)
    budgets = result["settings"]["budgets"]
    assert all(d[k] <= budgets[k] + 1e-9 for d in designs.values() for k in ("power",)
               if d["budget"] == "power")
    assert set(result["moved"]) == {f"{s}/{d}" for s in ("splitwise", "cls")
                                    for d in ("Splitwise-AA", "Splitwise-HH", "Splitwise-HA", "Splitwise-HHcap")}
    assert result["fig12"]["prompt"] >= 1
    assert len(result["claims"]) == 18
    for claim in result["claims"]:
        assert isinstance(claim["same_winner"], bool) and isinstance(claim["within_25pct"], bool)
    assert "same winner" in r.stdout and "within 25%" in r.stdout and "2.15" in r.stdout


def test_reproduce_cronus_quick(tmp_path: Path) -> None:
    out = tmp_path / "cronus.json"
    r = subprocess.run([sys.executable, str(SCRIPTS / "reproduce_cronus.py"), "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["requests"] == 60
    # Every design ran on every pair and model, and served every request.
    assert {(c["design"], c["low"], c["model"]) for c in result["cells"]} == {
        (d, low, m) for d in ("cronus", "dp", "pp", "disagg-hl", "disagg-lh") for low in ("a10", "a30")
        for m in ("llama3-8b", "qwen2-7b")}
    assert all(c["throughput"] > 0 and c["online_throughput"] > 0 and c["tbt_p99"] > 0 for c in result["cells"])
    # Every claim the paper states is judged, with our ratio beside the paper's.
    assert len(result["verdicts"]) == 16 and all(v["ours"] > 0 for v in result["verdicts"])
    assert "Table 2" in r.stdout and "same winner" in r.stdout


def test_reproduce_ecoserve_quick(tmp_path: Path) -> None:
    out = tmp_path / "ecoserve.json"
    r = subprocess.run([sys.executable, str(SCRIPTS / "reproduce_ecoserve.py"), "--quick", "--duration", "8",
                        "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(out.read_text())
    cell = result["goodput"]["l20/codellama-34b/sharegpt"]
    assert set(cell) == {"ecoserve", "vllm", "mooncake"}
    for design in cell.values():
        assert design["p50"] >= design["p90"] >= design["p99"] >= 0 and design["points"]
    assert result["ratios"] and all({"ours", "paper", "same_winner", "within_25"} <= set(row)
                                    for row in result["ratios"])
    assert set(result["fig9"]["ecoserve"]["p90"]) == {"1", "2", "4"}
    assert len(result["fig10"]["windows"]) == 2 and "EcoServe" in r.stdout
