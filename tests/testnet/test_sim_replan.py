"""Nodes lost and plans replaced during a simulated run (replan.py): a lost node's work is lost and the requests
on it move; a lightweight re-plan keeps every surviving shard and its sessions, only roles flip; a full one
drops the shards it changes and serves once they have loaded; bad input is a ConfigError."""

from __future__ import annotations

import math
from dataclasses import replace
from importlib.resources import files

import pytest

from hetnode.errors import ConfigError
from hetnode.planner.cluster import load_cluster
from hetnode.planner.model import model_spec
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.planner.profile import ProfileTable
from hetnode.planner.profile_sources import profile_table_for
from hetnode.planner.thunderserve.reschedule import reschedule
from hetnode.planner.thunderserve.settings import CODING, ThunderServeOptions
from hetnode.testnet.sim import SimOptions, SimResult, load_trace, poisson, simulate
from hetnode.testnet.sim.replan import Loss, Replan, after_loss, parse_loss
from hetnode.testnet.sim.tp_stages import merge_tensor_parallel

CLOUD = load_cluster(str(files("hetnode.testnet") / "clusters" / "thunderserve-cloud-gpus.toml"))
PREFILL = [("8xa40-0-gpu0", "8xa40-0-gpu1"), ("8xa40-0-gpu2", "8xa40-0-gpu3")]
DECODE = [("4xa6000-1-gpu0", "4xa6000-1-gpu1"), ("4xa6000-1-gpu2", "4xa6000-1-gpu3")]
# Only the plan's GPUs: a GPU it leaves idle would make the coordinator search anew rather than reschedule.
CLUSTER = replace(CLOUD, nodes=tuple(n for n in CLOUD.nodes if n.name in {g for c in PREFILL + DECODE for g in c}))
MODEL = model_spec("llama-30b")
OPTIONS = ThunderServeOptions(traffic=replace(CODING, rate=1.0), steps=10, neighbours=5)
LOST = "4xa6000-1-gpu0"  # the first stage of the first decode replica
LOSS = Loss(20.0, (LOST,))
DURATION = 60.0


def plan() -> PlacementPlan:
    """Two TP-2 prefill replicas on the A40s, two decode replicas of two stages on one A6000 host, its TSTP
    solved (Appendix F's shape, smaller)."""
    placements = [NodePlacement(n, 0, 60) for cell in PREFILL for n in cell]
    placements += [NodePlacement(c[0], 0, 30) for c in DECODE] + [NodePlacement(c[1], 30, 60) for c in DECODE]
    given = PlacementPlan(cluster=CLUSTER.name, model=MODEL.name, num_layers=60, method="thunderserve",
                          placements=tuple(placements), partial_inference=False,
                          replicas=(*(Replica("prefill", c, tp=2) for c in PREFILL),
                                    *(Replica("decode", c) for c in DECODE)))
    return reschedule(given, CLUSTER, MODEL, OPTIONS, steps=0)


PLAN = plan()


def profiles(p: PlacementPlan) -> ProfileTable:
    return profile_table_for(merge_tensor_parallel(p, CLUSTER)[1], MODEL, "roofline", kv_share=OPTIONS.kv_reserve)


def run(replan: Replan | None, loss: Loss | None = LOSS, rate: float = 1.0) -> SimResult:
    return simulate(CLUSTER, MODEL, profiles(PLAN), PLAN, workload=poisson(rate, lengths=load_trace("code"),
                                                                            duration_s=DURATION, seed=1),
                    scheduler="tstp", duration_s=DURATION, warmup_s=0.0, options=SimOptions(prefill_tokens=1024),
                    slos={"e2e": 30.0}, loss=loss, replan=replan)


def events(result: SimResult) -> dict[str, dict[str, object]]:
    return {e["event"]: e for e in result.summary["replan"]}


def test_a_lost_node_does_nothing_more_and_the_requests_on_it_move_and_finish() -> None:
    result = run(None)
    loss = events(result)["loss"]
    assert loss["nodes"] == [LOST] and loss["requests_moved"] == result.summary["requests"]["moved_lost"] > 0
    rs = result.requests
    assert all(r.finished and r.generated == r.output_len for r in rs)  # the moved ones too, after a re-prefill
    # What ran on the lost node finished before it went; its stage (and its replica) serves nothing after.
    assert all(r.finish < LOSS.at for r in rs if LOST in r.path)
    assert any(r.moves for r in rs) and all(r.arrival < LOSS.at for r in rs if r.moves)
    bins = result.timeseries.node_utilization
    after = math.ceil(LOSS.at / result.timeseries.bin_s) + 1
    busy = {name: sum(bins[name][after:]) for name in bins}
    assert busy[LOST] == 0 and busy["4xa6000-1-gpu1"] == 0  # its replica's other stage: nothing routes there
    assert busy["4xa6000-1-gpu2"] > 0


def test_without_the_loss_nothing_moves() -> None:
    result = run(None, loss=None)
    assert "replan" not in result.summary and result.summary["requests"]["moved_lost"] == 0


def test_a_lightweight_replan_keeps_every_surviving_shard_and_its_sessions() -> None:
    light = after_loss(PLAN, CLUSTER, MODEL, LOSS, "lightweight", options=OPTIONS, delay_s=1.0, profiles=profiles)
    assert light is not None and light.note == "" and light.plan.notes[0].startswith("lightweight reschedule")
    result = run(light)
    e = events(result)
    assert e["replan"]["at"] == LOSS.at + 1.0 and e["replan"]["reloaded"] == [] and e["replan"]["requests_moved"] == 0
    # The broken decode replica's surviving stage is left idle; the rest keep their layers, roles may flip.
    assert e["replan"]["dropped"] == ["4xa6000-1-gpu1"]
    assert set(e["replan"]["kept"]) == {"8xa40-0-gpu0", "8xa40-0-gpu2", "4xa6000-1-gpu2", "4xa6000-1-gpu3"}
    # No reload: it serves after one round trip of assignments.
    assert e["replan"]["at"] < e["ready"]["at"] == e["replan"]["ready_at"] < e["replan"]["at"] + 0.1
    assert all(r.finished and r.generated == r.output_len for r in result.requests)
    roles = {n: r.role for r in merge_tensor_parallel(light.plan, CLUSTER)[0].replicas for n in r.nodes}
    for r in result.requests:
        if r.admitted > e["ready"]["at"]:  # routed by the new plan's scheduler: its prefill replica, its decode one
            prefill, decode = (part.split(">") for part in r.path.split(" | "))
            assert {roles[h.split("[")[0]] for h in prefill} == {"prefill"}
            assert {roles[h.split("[")[0]] for h in decode} == {"decode"}


def test_a_full_replan_drops_the_shards_it_changes_and_serves_once_they_have_loaded() -> None:
    full = after_loss(PLAN, CLUSTER, MODEL, LOSS, "full", options=OPTIONS, delay_s=1.0, reload_s=10.0,
                      profiles=profiles)
    assert full is not None and full.how == "full"
    result = run(full)
    e = events(result)["replan"]
    ready = events(result)["ready"]["at"]
    assert e["reloaded"] and ready >= e["at"] + 10.0
    new = {n.name for n in result.nodes if n.name.endswith("(re-plan)")} | set(e["reloaded"])
    assert new
    for r in result.requests:
        assert r.finished and r.generated == r.output_len  # the wait for the new plan is shorter than 30 s
        if e["at"] <= r.admitted < ready:  # while it loads, only shards it kept serve
            assert not set(e["reloaded"]) - set(e["kept"]) & {h.split("[")[0] for h in r.path.replace(" | ", ">")
                                                               .split(">")}
    assert any(r.admitted >= ready for r in result.requests)


def test_requests_wait_for_a_plan_that_can_serve_at_most_the_route_wait() -> None:
    """A reload longer than the coordinator's --route-wait (30 s): requests that wait that long in vain end,
    as the runtime answers 503; the later ones are served by the new plan."""
    full = after_loss(PLAN, CLUSTER, MODEL, LOSS, "full", options=OPTIONS, delay_s=1.0, reload_s=35.0,
                      profiles=profiles)
    result = run(full)
    refused = [r for r in result.requests if r.rejected]
    assert refused and all("no pipeline is ready to serve within 30 s" in r.rejected for r in refused)
    replanned, ready = events(result)["replan"]["at"], events(result)["ready"]["at"]
    waited = [r for r in result.requests if replanned <= r.arrival < ready]
    assert all(r.finished == (r.arrival >= ready - 30.0) for r in waited)
    assert all(r.finished for r in result.requests if r.arrival >= ready)


def test_bad_losses_and_replans_are_config_errors() -> None:
    assert parse_loss("a,b@12.5") == Loss(12.5, ("a", "b"))
    for text in ("a", "@3", "a@", "a@-1", "a@soon"):
        with pytest.raises(ConfigError, match="NODE"):
            parse_loss(text)
    with pytest.raises(ConfigError, match="has no node nope"):
        run(None, loss=Loss(5.0, ("nope",)))
    with pytest.raises(ConfigError, match="outside the run"):
        run(None, loss=Loss(DURATION, (LOST,)))
    light = after_loss(PLAN, CLUSTER, MODEL, LOSS, "lightweight", options=OPTIONS, delay_s=1.0, profiles=profiles)
    assert light is not None
    with pytest.raises(ConfigError, match="before the loss"):
        run(replace(light, at=LOSS.at - 1))
    with pytest.raises(ConfigError, match="went down"):
        run(replace(light, plan=PLAN))  # a plan that still places the lost GPU
    helix = replace(PLAN, method="helix", replicas=(), orchestration=None)
    with pytest.raises(ConfigError, match="lightweight rescheduling is ThunderServe's"):
        after_loss(helix, CLUSTER, MODEL, LOSS, "lightweight")
    with pytest.raises(ConfigError, match="--reschedule must be one of"):
        after_loss(PLAN, CLUSTER, MODEL, LOSS, "gentle")
    assert after_loss(PLAN, CLUSTER, MODEL, LOSS, "none") is None
