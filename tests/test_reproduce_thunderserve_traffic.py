"""scripts/reproduce_thunderserve.py plans ThunderServe for the lengths the simulator then draws (issue 14: it
planned for the whole trace's means, 2048 prompt tokens coding, and simulated Helix's length-filtered trace,
844, so the planner and the simulator disagreed on which phase bounds a plan)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from reproduce_thunderserve import PLAN_RATE, Lab, cluster

from hetnode.planner.placement import PlannerOptions, plan_placement
from hetnode.planner.profile_sources import profile_table_for
from hetnode.planner.thunderserve.reschedule import sustained_rate


@pytest.mark.parametrize("traffic", ["code", "conv"])
def test_thunderserve_plans_for_the_trace_it_is_simulated_on(traffic: str) -> None:
    lab = Lab(duration_s=10.0, warmup_s=1.0, seed=0)
    trace = lab.traces[traffic]
    planned = lab.ts_options(traffic).traffic
    assert planned.input_len == pytest.approx(statistics.fmean(trace.inputs))
    assert planned.output_len == pytest.approx(statistics.fmean(trace.outputs))
    assert planned.rate == PLAN_RATE


def test_each_run_is_routed_by_the_tstp_solved_for_the_rate_it_offers() -> None:
    """A run at R requests/s routes by the orchestration re-solved at R, a saturating run by the one solved at
    what the planner expects the plan to sustain; the deployment stays the one planned at PLAN_RATE."""
    lab = Lab(duration_s=10.0, warmup_s=1.0, seed=0)
    opts = lab.ts_options("code")
    cloud = cluster("thunderserve-cloud-gpus")
    ts = plan_placement(cloud, lab.model, profile_table_for(cloud, lab.model, "roofline", kv_share=opts.kv_reserve),
                        method="thunderserve", options=PlannerOptions(seed=0, thunderserve=opts))
    sustains = sustained_rate(ts, cloud, lab.model, opts)
    assert sustains > PLAN_RATE
    lab.run("saturating", cloud, ts, "code", None, opts.kv_reserve, tstp=opts)
    lab.run("light", cloud, ts, "code", 2.0, opts.kv_reserve, tstp=opts)
    assert f"TSTP at {sustains:.2f}/s" in lab.log[0] and "TSTP at 2.00/s" in lab.log[1]
