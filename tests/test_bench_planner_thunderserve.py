"""Smoke run of scripts/bench_planner.py --thunderserve with a short reference search: every cluster size and
traffic timed and estimated, every rescheduling case measured beside its references."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_planner.py"


def test_bench_planner_thunderserve_quick() -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--thunderserve", "--ts-reference-steps", "10", "--json"],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout)
    rows = result["thunderserve"]
    assert [(row["gpus"], row["traffic"]) for row in rows] == [(g, t) for g in (16, 24, 32) for t in ("code", "conv")]
    for row in rows:
        assert 0 <= row["converged_cpu_seconds"] <= row["cpu_seconds"]
        assert 0 <= row["attainment"] <= 1 and 0 <= row["reference_attainment"] <= 1
        assert {"prefill", "decode"} <= set(row["replicas"])
    cases = [(c["case"], c["from"], c["to"]) for c in result["reschedule"]]
    assert cases == [("shift", "code", "conv"), ("shift", "conv", "code"), ("lost 4", "code", "code"),
                     ("lost 4", "conv", "conv")]
    for case in result["reschedule"]:
        assert case["cpu_seconds"] > 0
        a = case["attainment"]
        assert set(a) == {"light", "longer", "kept", "full"}
        # The flip-only search starts from the kept phases and keeps its best: never below them.
        assert a["light"] >= a["kept"] - 1e-9 and a["longer"] >= a["light"] - 1e-9
        assert len(case["gone"]) == (4 if case["case"] == "lost 4" else 0)
