"""scripts/reproduce_thunderserve.py plans ThunderServe for the lengths the simulator then draws (issue 14: it
planned for the whole trace's means, 2048 prompt tokens coding, and simulated Helix's length-filtered trace,
844, so the planner and the simulator disagreed on which phase bounds a plan)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from reproduce_thunderserve import PLAN_RATE, Lab


@pytest.mark.parametrize("traffic", ["code", "conv"])
def test_thunderserve_plans_for_the_trace_it_is_simulated_on(traffic: str) -> None:
    lab = Lab(duration_s=10.0, warmup_s=1.0, seed=0)
    trace = lab.traces[traffic]
    planned = lab.ts_options(traffic).traffic
    assert planned.input_len == pytest.approx(statistics.fmean(trace.inputs))
    assert planned.output_len == pytest.approx(statistics.fmean(trace.outputs))
    assert planned.rate == PLAN_RATE
