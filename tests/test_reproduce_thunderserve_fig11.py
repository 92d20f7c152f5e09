"""scripts/reproduce_thunderserve.py's Fig. 11 (issue 14): Appendix F's deployments as the paper gives them, and
Appendix G's loss of one 4xA6000 instance taking two of their decode replicas, not every one."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from reproduce_thunderserve import APPENDIX_F, APPENDIX_G_GONE, Lab, Lost, appendix_f_plan, cluster, pattern
from test_reproduce_thunderserve import run_quick

from hetnode.planner.model import model_spec
from hetnode.planner.profile_sources import profile_table_for
from hetnode.planner.thunderserve.reschedule import reschedule
from hetnode.planner.validate import validate_plan

CLOUD = cluster("thunderserve-cloud-gpus")
MODEL = model_spec("llama-30b")
# Appendix F's text, GPUs of each type per phase (prefill, decode), and its replicas per phase.
PAPER = {"code": ({"a40": (8, 0), "a6000": (4, 4), "a5000": (6, 2), "3090ti": (2, 6)}, (8, 4)),
         "conv": ({"a40": (6, 2), "a6000": (0, 8), "a5000": (2, 6), "3090ti": (2, 6)}, (4, 8))}


LAB = Lab(duration_s=10.0, warmup_s=1.0, seed=0)  # the options the script plans with


@pytest.mark.parametrize("traffic", ["code", "conv"])
def test_appendix_f_plan_is_the_papers_deployment(traffic: str) -> None:
    opts = LAB.ts_options(traffic)
    plan = appendix_f_plan(CLOUD, MODEL, opts, traffic)
    assert validate_plan(plan, CLOUD, MODEL, profile_table_for(CLOUD, MODEL, "roofline",
                                                                   kv_share=opts.kv_reserve)) == []
    seen = pattern(plan, CLOUD)
    by_type, (prefill, decode) = PAPER[traffic]
    assert (seen["prefill_replicas"], seen["decode_replicas"]) == (prefill, decode)
    assert {k: (v["prefill"], v["decode"]) for k, v in seen["gpus_by_type"].items()} == by_type
    # Each group on the paper's GPUs with its (tp, pp): pp stages of tp GPUs each.
    groups = {(frozenset(r.nodes), r.tp, len(r.nodes) // r.tp, r.role) for r in plan.replicas}
    assert groups == {(frozenset(names), tp, len(names) // tp, role) for names, tp, role in APPENDIX_F[traffic]}
    assert sum(len(r.nodes) for r in plan.replicas) == len({n for r in plan.replicas for n in r.nodes}) == 32


@pytest.mark.parametrize("traffic", ["code", "conv"])
def test_appendix_g_loss_takes_two_decode_replicas_and_leaves_the_others(traffic: str) -> None:
    opts = LAB.ts_options(traffic)
    plan = appendix_f_plan(CLOUD, MODEL, opts, traffic)
    kept = reschedule(plan, CLOUD, MODEL, opts, gone=APPENDIX_G_GONE, steps=0)
    assert kept.notes[0].startswith("lightweight reschedule of 12 replicas: 2 dropped")
    # Appendix G: 8 prefill and 2 decode remain coding, 4 and 6 conversation.
    remaining = {"code": (8, 2), "conv": (4, 6)}[traffic]
    roles = [r.role for r in kept.replicas]
    assert (roles.count("prefill"), roles.count("decode")) == remaining
    assert not {n for r in kept.replicas for n in r.nodes} & set(APPENDIX_G_GONE)


@pytest.mark.slow
def test_only_fig11_reports_our_plan_and_the_papers(tmp_path: Path) -> None:
    _, result = run_quick(tmp_path, "--only", "fig11")
    assert len(result["claims"]) == 8 and {c["section"] for c in result["claims"]} == {"5.4"}
    for key in ("code", "conv", "code (Appendix F's plan)", "conv (Appendix F's plan)"):
        facts = result["facts"][key]
        assert len(facts["gone"]) == 4
        assert set(facts["attainment_after_loss"]) == set(facts["attainment_from_the_loss"]) == {
            "lightweight", "full", "none"}
        before = facts["attainment_before"]  # none arrive before the loss less the SLO in a --quick run of conv
        assert (math.isnan(before) or 0 <= before <= 1) and facts["fig11_rate"] > 0
        # One run per arm: the loss, then (but for none) the re-plan and the switch to it.
        replans = facts["replans"]
        assert [e["event"] for e in replans["none"]] == ["loss"]
        assert [e["event"] for e in replans["lightweight"]] == ["loss", "replan", "ready"]
        light = replans["lightweight"][1]
        if "searching anew" in light["note"]:
            # The survivors cannot serve both phases (a plan whose one decode replica the loss took): the
            # coordinator's rule is a full search then, which reloads.
            assert light["reloaded"] and "Appendix F" not in key
        else:
            assert light["reloaded"] == []  # no weights reloaded
        assert replans["full"][2]["at"] >= replans["full"][1]["at"] + 103.0  # a reload, in the drain at --quick
    assert result["facts"]["code (Appendix F's plan)"]["gone"] == list(APPENDIX_G_GONE)


def test_a_lightweight_plan_that_attains_nothing_beats_no_one() -> None:
    """0% against 0% names no winner (it was inf, 'lightweight better', in the Results table of issue 14's earlier
    rounds); only a plan that attains something beats one that attains nothing."""
    def verdicts(light: float, full: float, none: float) -> list[dict[str, object]]:
        arms = {"lightweight": light, "full": full, "none": none}
        lost = Lost(gone=(), bound=5.5, rate=4.0, loss_at=240.0, settled_from=400.0, before=0.5, attainment=arms,
                    after=arms, light_notes=("",))
        return [c.verdict() for c in lost.claims("code")]

    vs_full, vs_none = verdicts(0.0, 0.0, 0.0)
    assert math.isnan(float(str(vs_full["ours"]))) and math.isnan(float(str(vs_none["ours"])))
    assert vs_none["same_winner"] is False
    vs_full, vs_none = verdicts(0.3, 0.6, 0.0)
    assert vs_full["ours"] == pytest.approx(0.5)
    assert vs_none["ours"] == math.inf and vs_none["same_winner"] is True
    assert verdicts(0.6, 0.6, 0.5)[1]["ours"] == pytest.approx(1.2)
