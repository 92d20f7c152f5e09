"""scripts/reproduce_thunderserve.py --deployment (issue 14): the Results rows on Appendix F's own deployment, and
our planner's plan attaining more than the paper's in the simulator (so the paper's 12 small replicas are not a
deployment the search fails to reach to its cost)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from reproduce_thunderserve import APPENDIX_F, Lab, cluster, e2e_attainment, thunderserve_plan
from test_reproduce_thunderserve import run_quick

from hetnode.planner.thunderserve.slo import slo_for

CLOUD = cluster("thunderserve-cloud-gpus")


@pytest.mark.parametrize("traffic", ["code", "conv"])
def test_the_searchs_plan_attains_more_than_appendix_fs_in_the_simulator(traffic: str) -> None:
    # Both deployments routed by their TSTP at the planned rate, the same Poisson arrivals of the whole trace: the
    # search's plan attains the E2E SLO for more requests (code 0.75 against 0.26, conversation 0.96 against 0.44,
    # 150 simulated seconds), as our estimator ranks them too (0.66 against 0.57, 0.96 against 0.32; it rates
    # Appendix F's coding plan higher than the simulator does: docs/reproducing-thunderserve.md, fifteenth part).
    lab = Lab(duration_s=150.0, warmup_s=30.0, seed=0)
    opts = lab.ts_options(traffic)
    ours = thunderserve_plan(lab, CLOUD, opts, traffic)
    paper = thunderserve_plan(lab, CLOUD, opts, traffic, "appendix-f")
    assert len(paper.replicas) == len(APPENDIX_F[traffic]) == 12
    bound = slo_for(lab.model, opts).e2e_s
    rate = opts.traffic.rate
    attained = {name: e2e_attainment(lab.run(name, CLOUD, plan, traffic, rate, opts.kv_reserve, tstp=opts), bound)
                for name, plan in (("ours", ours), ("paper", paper))}
    assert attained["ours"] > attained["paper"] + 0.1


@pytest.mark.slow
def test_deployment_appendix_f_runs_the_results_rows_on_the_papers_plan(tmp_path: Path) -> None:
    _, result = run_quick(tmp_path, "--deployment", "appendix-f")
    claims = {c["claim"]: c for c in result["claims"]}
    for traffic in ("code", "conv"):
        assert f"throughput vs HexGen-like, {traffic}" in claims
        assert result["facts"][traffic]["gone"] == [f"4xa6000-1-gpu{k}" for k in range(4)]
    # Table 3's row on the paper's own plans: 8:4 coding over 4:8 conversation.
    assert claims["prefill:decode replicas, code over conversation"]["ours"] == pytest.approx(4.0)
    assert any("thunderserve plan (appendix-f) code" in line for line in result["log"])
