"""Smoke run of scripts/reproduce_thunderserve.py --quick: every claim measured and judged, the plans' pattern
and the lost-GPU comparison reported. The ratios themselves are for the full run (docs/reproducing-thunderserve.md)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "reproduce_thunderserve.py"


def run_quick(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    """The script at --quick with `args`: its output, and its --json results (it must exit 0)."""
    out = tmp_path / "ts.json"
    r = subprocess.run([sys.executable, str(SCRIPT), *args, "--quick", "--json", str(out)], capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r, json.loads(out.read_text())


def test_reproduce_thunderserve_quick(tmp_path: Path) -> None:
    r, result = run_quick(tmp_path)
    claims = result["claims"]
    assert {c["section"] for c in claims} == {"5.2", "5.3", "5.4"}
    assert len(claims) == 17
    for c in claims:
        assert isinstance(c["within_25pct"], bool)
        assert (c["same_winner"] is None) == (c["paper"] == 1.0)
        assert c["paper"] > 0
    throughput = [c for c in claims if c["claim"].startswith("throughput")]
    assert len(throughput) == 6 and all(math.isfinite(c["ours"]) and c["ours"] > 0 for c in throughput)
    for traffic in ("code", "conv"):
        facts = result["facts"][traffic]
        assert len(facts["gone"]) == 4
        assert set(facts["attainment_after_loss"]) == {"lightweight", "full", "none"}
        assert all(v > 0 for v in facts["throughput_req_s"].values())
        assert facts["plan"]["prefill_replicas"] >= 1 and facts["plan"]["decode_replicas"] >= 1
    assert "same winner" in r.stdout and "within 25%" in r.stdout
