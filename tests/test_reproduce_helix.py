"""scripts/reproduce_helix.py (issue 13): each row runs the way Helix's artifact ran it: a hand-set count in flight
for the schedulers that cannot refuse a request, and the separate pipelines one simulation each."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from reproduce_helix import PAPER_TIMES, Reproduction, Setup, separate_pipelines

from hetnode.planner.plan import PlacementPlan


@pytest.fixture(scope="module")
def repro() -> Reproduction:
    return Reproduction(times=PAPER_TIMES, time_limit=None, peak="measured", plans_dir=None, log=lambda _: None)


def test_an_sp_plan_splits_into_its_pipelines_with_their_flow(repro: Reproduction) -> None:
    plan = repro.plan("single", "30B", "sp")
    parts = separate_pipelines(plan)
    cl = repro.cluster("single")
    assert sorted({cl.node(p.node).device for p in part.placements}.pop() for part in parts) == ["a100", "l4", "t4"]
    assert sum(part.max_flow for part in parts) == pytest.approx(plan.max_flow)
    for part in parts:
        names = {p.node for p in part.placements}
        ranges = sorted((p.first_layer, p.last_layer) for p in part.placements)
        assert ranges[0][0] == 0 and ranges[-1][1] == plan.num_layers  # a whole model each
        assert all(a in names | {"source"} and b in names | {"sink"} for a, b in part.flows)
        assert part.connections and all(a in names and b in names for a, b in part.connections)


def test_a_plan_whose_requests_may_cross_is_one_simulation(repro: Reproduction) -> None:
    plan = repro.plan("single", "70B", "swarm")
    assert plan.connections is None and separate_pipelines(plan) == [plan]
    one = PlacementPlan.from_json({**repro.plan("single", "30B", "sp").to_json(), "connections": None})
    assert separate_pipelines(one) == [one]


def test_rows_run_as_the_artifact_ran_them(repro: Reproduction) -> None:
    def how(cl: str, m: str, placement: str, scheduler: str, mode: str = "offline") -> list[tuple[str, int | None]]:
        plan = repro.plan(cl, m, placement if placement != "helix" else "petals")  # any plan of one pipeline set
        return [(sched, n) for _, sched, n, _ in repro.parts(Setup(cl, m, placement, scheduler, mode), plan)]

    # §6.7 on the single cluster's prototype, 240 in flight; the geo simulation 180; Helix's own loop for IWRR.
    assert how("single", "70B", "helix", "random") == [("random", 240)]
    assert how("geo", "70B", "helix", "shortest-queue") == [("shortest-queue", 180)]
    assert how("single", "70B", "helix", "iwrr") == [("iwrr", None)]
    assert how("single", "30B", "swarm", "swarm") == [("swarm", 50)]
    assert how("hetero", "70B", "swarm", "swarm") == [("swarm", 500)]
    assert how("single", "30B", "swarm", "swarm", "online") == [("swarm", None)]  # online: the trace's arrivals
    # The separate pipelines: one simulation each, random scheduling, 30/25/25 in flight by GPU type.
    plan = repro.plan("single", "30B", "sp")
    parts = repro.parts(Setup("single", "30B", "sp", "iwrr", "offline"), plan)
    assert sorted((kind, sched, n) for _, sched, n, kind in parts) == [
        ("a100", "random", 30), ("l4", "random", 25), ("t4", "random", 25)]
    # Helix's placement where it is the separate pipelines' (30B): apart too, under its own scheduler and loop.
    helix = repro.parts(Setup("single", "30B", "helix", "iwrr", "offline"), plan)
    assert [(sched, n) for _, sched, n, _ in helix] == [("iwrr", None)] * 3


def test_hetnodes_settings_run_every_row_as_one_simulation() -> None:
    repro = Reproduction(times=PAPER_TIMES, time_limit=None, peak="measured", plans_dir=None, log=lambda _: None,
                         like="hetnode")
    plan = repro.plan("single", "30B", "sp")
    assert [(p, n) for p, _, n, _ in repro.parts(Setup("single", "30B", "sp", "iwrr", "offline"), plan)] == [
        (plan, None)]
    assert repro.parts(Setup("single", "70B", "helix", "random", "offline"), plan)[0][2] is None


def test_online_rows_run_at_the_artifacts_hand_set_rates(repro: Reproduction) -> None:
    """Helix's artifact loaded each online system at a rate it set by hand (step3_simulation.py), not at 75% of its
    peak: Swarm on geo 70B at 350 tokens/s, SP's pipelines each at their own; a row it set none for keeps 75%."""
    assert repro.online_rate == "artifact"
    assert repro.artifact_rate(Setup("geo", "70B", "swarm", "swarm", "online"), "") == 350
    assert repro.artifact_rate(Setup("geo", "70B", "sp", "iwrr", "online"), "a100") == 240
    assert repro.artifact_rate(Setup("single", "30B", "helix", "iwrr", "online"), "t4") == 170
    assert repro.artifact_rate(Setup("hetero", "70B", "sp", "iwrr", "online"), "2xt4") is None  # not run there
    assert repro.artifact_rate(Setup("single", "70B", "sp", "iwrr", "online"), "a100") is None  # not written
    peak = Reproduction(times=PAPER_TIMES, time_limit=None, peak="measured", plans_dir=None, log=lambda _: None)
    peak.online_rate = "peak"
    assert peak.artifact_rate(Setup("geo", "70B", "swarm", "swarm", "online"), "") is None
    hetnode = Reproduction(times=PAPER_TIMES, time_limit=None, peak="measured", plans_dir=None, log=lambda _: None,
                           like="hetnode")
    assert hetnode.online_rate == "peak"


def test_the_geo_coordinator_is_in_no_region_as_the_artifact_generated_it(repro: Reproduction) -> None:
    """Helix's geo cluster file has every coordinator link cross regions; the shipped helix-geo has it in region1.
    Under --like helix the simulations take the artifact's; the single cluster and hetnode's settings do not."""
    shipped, simulated = repro.cluster("geo"), repro.sim_cluster("geo")
    assert shipped.link("coordinator", "a100-0").latency_ms == 1
    assert simulated.link("coordinator", "a100-0") == simulated.link("t4-0", "coordinator") == shipped.link(
        "a100-0", "t4-0")  # the cross-region link, 100 Mb/s and 50 ms
    assert simulated.link("a100-0", "a100-1") == shipped.link("a100-0", "a100-1")
    assert repro.sim_cluster("single") is repro.cluster("single")
    hetnode = Reproduction(times=PAPER_TIMES, time_limit=None, peak="measured", plans_dir=None, log=lambda _: None,
                           like="hetnode")
    assert hetnode.sim_cluster("geo") is hetnode.cluster("geo")
