"""`scripts/bench_e2e.py --quick` runs and reports every cell: our engine beside transformers, and serving by the
local engine and by a multi-process testnet (hence the file's name: it runs with the longest tests, first)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


# Not `alone`: it checks that the benchmark runs and reports every cell, not what the cells measure.
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
