"""Lightweight rescheduling (§3.4): layouts kept, only phases and the orchestration change; GPUs gone drop their
groups whole; the plan read back from JSON reschedules the same; bad input is a ConfigError."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from importlib.resources import files

import pytest

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec, load_cluster
from hetnode.planner.model import model_spec
from hetnode.planner.placement import PlannerOptions, plan_placement
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.profile_sources import profile_table_for
from hetnode.planner.thunderserve.deploy import thunderserve_placement
from hetnode.planner.thunderserve.deployment import holds_model, initial
from hetnode.planner.thunderserve.gpus import gpu_pool
from hetnode.planner.thunderserve.parallel import DECODE, PREFILL
from hetnode.planner.thunderserve.reschedule import kept_groups, replan, reschedule, sustained_rate
from hetnode.planner.thunderserve.settings import CODING, CONVERSATION, ThunderServeOptions
from hetnode.planner.validate import validate_plan

CLOUD = load_cluster(str(files("hetnode.testnet") / "clusters" / "thunderserve-cloud-gpus.toml"))
MODEL = model_spec("llama-30b")
QUICK = ThunderServeOptions(steps=8, neighbours=6, traffic=replace(CODING, rate=4.0))
PLAN = thunderserve_placement(CLOUD, MODEL, QUICK)


def layouts(plan: PlacementPlan) -> set[tuple[tuple[str, ...], int, tuple[tuple[int, int], ...]]]:
    ranges = {p.node: (p.first_layer, p.last_layer) for p in plan.placements}
    return {(r.nodes, r.tp, tuple(ranges[n] for n in r.nodes)) for r in plan.replicas}


def test_no_flips_and_the_same_workload_give_back_the_plans_own_estimate() -> None:
    # The layouts read back from the plan price exactly as the search priced them.
    again = reschedule(PLAN, CLOUD, MODEL, QUICK, steps=0)
    assert again.orchestration is not None and PLAN.orchestration is not None
    assert again.orchestration.slo_attainment == pytest.approx(PLAN.orchestration.slo_attainment, abs=1e-9)
    assert layouts(again) == layouts(PLAN)
    assert [r.role for r in again.replicas] == [r.role for r in PLAN.replicas]


def test_a_workload_shift_keeps_every_layout_and_never_ends_worse_than_keeping_the_phases() -> None:
    shifted = replace(QUICK, traffic=replace(CONVERSATION, rate=4.0))
    light = reschedule(PLAN, CLOUD, MODEL, shifted, steps=30)
    kept = reschedule(PLAN, CLOUD, MODEL, shifted, steps=0)
    assert layouts(light) == layouts(PLAN)  # no weights move
    assert light.orchestration is not None and kept.orchestration is not None
    assert light.orchestration.slo_attainment >= kept.orchestration.slo_attainment - 1e-9
    profiles = profile_table_for(CLOUD, MODEL, "roofline", kv_share=QUICK.kv_reserve)
    assert validate_plan(light, CLOUD, MODEL, profiles) == []


def test_losing_every_decode_gpu_makes_a_prefill_group_flip() -> None:
    gone = [n for r in PLAN.replicas if r.role == DECODE for n in r.nodes]
    kept = reschedule(PLAN, CLOUD, MODEL, QUICK, gone=gone, steps=0)
    light = reschedule(PLAN, CLOUD, MODEL, QUICK, gone=gone, steps=10)
    assert kept.orchestration is not None and kept.orchestration.slo_attainment == 0.0
    assert {r.role for r in light.replicas} == {PREFILL, DECODE}
    # The flipped group serves: whether it also attains the E2E SLO depends on the plan's layouts (a deep prefill
    # pipeline's layout decoding may be too slow for it), not on the flip.
    assert sustained_rate(kept, CLOUD, MODEL, QUICK) == 0.0 < sustained_rate(light, CLOUD, MODEL, QUICK)
    assert not set(gone) & {n for r in light.replicas for n in r.nodes}
    prefill = {r.nodes for r in PLAN.replicas if r.role == PREFILL}
    assert {r.nodes for r in light.replicas} == prefill
    assert "flipped" in light.notes[0]


def test_a_group_that_lost_one_gpu_is_dropped_whole() -> None:
    victim = max(PLAN.replicas, key=lambda r: len(r.nodes))
    kept = kept_groups(PLAN, CLOUD, gone=[victim.nodes[-1]])
    assert len(kept.dropped) == 1 and len(kept.groups) == len(PLAN.replicas) - 1
    assert victim.nodes[-1] not in {g.name for g in kept.pool.gpus}
    light = reschedule(PLAN, CLOUD, MODEL, QUICK, gone=[victim.nodes[-1]], steps=5)
    assert not set(victim.nodes) & {n for r in light.replicas for n in r.nodes}
    assert len(light.replicas) == len(PLAN.replicas) - 1


def test_a_plan_read_back_from_json_reschedules_the_same_and_a_seed_gives_one_answer() -> None:
    shifted = replace(QUICK, traffic=replace(CONVERSATION, rate=4.0), seed=5)
    again = PlacementPlan.from_json(json.loads(json.dumps(PLAN.to_json())))
    a = reschedule(PLAN, CLOUD, MODEL, shifted, steps=20)
    b = reschedule(again, CLOUD, MODEL, shifted, steps=20)
    assert a.to_json() | {"solve_time_s": 0} == b.to_json() | {"solve_time_s": 0}


def test_a_full_search_starts_on_gpus_left_over_from_broken_hosts() -> None:
    # A 4-GPU replica across two hosts gone: two A5000s (48 GB) are left of their host, and every cut of the
    # bandwidth dendrogram has them alone or everything in one group; they join their nearest group.
    # (In this order of the hosts no cut holds; the dendrogram's ties depend on the order.)
    gone = {"4xa6000-1-gpu2", "4xa6000-1-gpu3", "4xa5000-1-gpu0", "4xa5000-1-gpu1"}
    hosts = ["4xa6000-0", "4xa6000-1", "4xa5000-0", "4xa5000-1", "4x3090ti-0", "4x3090ti-1", "8xa40-0"]
    left = replace(CLOUD, nodes=tuple(sorted((n for n in CLOUD.nodes if n.name not in gone),
                                             key=lambda n: (hosts.index(n.host), n.name))))
    pool = gpu_pool(left)
    first = initial(pool, MODEL, random.Random(0))
    assert first is not None and len(first.groups) >= 2
    assert all(holds_model(pool, g.gpus, MODEL) for g in first.groups)
    assert sorted(g for grp in first.groups for g in grp.gpus) == list(range(len(pool)))
    plan = thunderserve_placement(left, MODEL, QUICK)
    assert {r.role for r in plan.replicas} == {PREFILL, DECODE}


def test_bad_input_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no node"):
        reschedule(PLAN, CLOUD, MODEL, QUICK, gone=["no-such-gpu"])
    with pytest.raises(ConfigError, match="no group"):
        reschedule(PLAN, CLOUD, MODEL, QUICK, gone=[n.name for n in CLOUD.nodes])
    profiles = profile_table_for(CLOUD, MODEL, "roofline", kv_share=QUICK.kv_reserve)
    petals = plan_placement(CLOUD, MODEL, profiles, method="petals", options=PlannerOptions())
    with pytest.raises(ConfigError, match="no replicas"):
        reschedule(petals, CLOUD, MODEL, QUICK)
    other = replace(CLOUD, nodes=CLOUD.nodes[:8])
    with pytest.raises(ConfigError, match="does not have"):
        reschedule(PLAN, other, MODEL, QUICK)
    torn = replace(PLAN, placements=PLAN.placements[1:])
    with pytest.raises(ConfigError, match="layer range"):
        reschedule(torn, CLOUD, MODEL, QUICK)


def test_what_a_plan_sustains_is_the_planners_own_estimate_whatever_rate_it_was_planned_for() -> None:
    sustains = sustained_rate(PLAN, CLOUD, MODEL, QUICK)
    assert f"the weaker phase sustains {sustains:.2f} requests/s" in PLAN.notes[0]
    assert sustained_rate(PLAN, CLOUD, MODEL, replace(QUICK, traffic=replace(QUICK.traffic, rate=1.0))) == sustains
    # Solved at that rate (a saturated deployment's), the orchestration leans on every prefill replica.
    full = reschedule(PLAN, CLOUD, MODEL, replace(QUICK, traffic=replace(QUICK.traffic, rate=sustains)), steps=0)
    assert full.orchestration is not None and min(full.orchestration.prefill_share) > 0.1
    assert [r.role for r in full.replicas] == [r.role for r in PLAN.replicas] and layouts(full) == layouts(PLAN)


def _same(a: PlacementPlan, b: PlacementPlan) -> bool:
    return replace(a, solve_time_s=0.0) == replace(b, solve_time_s=0.0)


def _without(gone: set[str]) -> ClusterSpec:
    return replace(CLOUD, nodes=tuple(n for n in CLOUD.nodes if n.name not in gone))


def test_a_loss_replans_lightly_a_full_replan_or_a_joined_node_searches_anew() -> None:
    """`replan`, what the coordinator and the simulator both ask after a loss: the lightweight reschedule of the
    plan in use, unless a full re-plan is asked for, a node the plan does not place is up, or nothing survives."""
    gone = {PLAN.replicas[-1].nodes[0]}
    light = replan(PLAN, CLOUD, _without(gone), MODEL, QUICK, light=True)
    # The plan's GPUs read back in its replicas' order, whatever the order of the cluster given.
    own = replace(CLOUD, nodes=tuple(CLOUD.node(n) for r in PLAN.replicas for n in r.nodes))
    assert light.why_full == "" and _same(light.plan, reschedule(PLAN, own, MODEL, QUICK, gone=gone))
    shuffled = replace(CLOUD, nodes=tuple(reversed(CLOUD.nodes)))
    assert _same(replan(PLAN, shuffled, _without(gone), MODEL, QUICK, light=True).plan, light.plan)
    full = replan(PLAN, CLOUD, _without(gone), MODEL, QUICK, light=False)
    assert full.why_full and _same(full.plan, thunderserve_placement(_without(gone), MODEL, QUICK))
    one_of_each = {r.nodes[0] for r in PLAN.replicas}
    broken = replan(PLAN, CLOUD, _without(one_of_each), MODEL, QUICK, light=True)
    assert "survives" in broken.why_full and "searching anew" in broken.why_full
    assert not one_of_each & {p.node for p in broken.plan.placements}
    last = {r.nodes[0] for r in PLAN.replicas[1:]}  # one group left: no flip serves both phases
    alone = replan(PLAN, CLOUD, _without(last), MODEL, QUICK, light=True)
    assert "no " in alone.why_full and "searching anew" in alone.why_full
    assert {r.role for r in alone.plan.replicas} == {PREFILL, DECODE}
    idle = replace(PLAN, placements=tuple(p for p in PLAN.placements if p.node not in gone),
                   replicas=PLAN.replicas[:-1])
    assert "joined" in replan(idle, CLOUD, CLOUD, MODEL, QUICK, light=True).why_full
