"""Routing a ThunderServe plan by its orchestration (tstp) and by random pairs: the shares X_i Y_ij hold over a
run, KV pressure moves a request to an open pair instead of blocking it, draws are seeded, bad plans refused;
and the simulator routes with the same objects."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from hetnode.coordinator.pair_schedulers import RandomPairScheduler, TstpScheduler
from hetnode.coordinator.routing import make_scheduler, scheduler_for
from hetnode.errors import ConfigError
from hetnode.planner.plan import NodePlacement, Orchestration, PlacementPlan, Replica

ORCH = Orchestration(prefill_share=(0.75, 0.25), decode_share=((1.0, 0.0), (0.5, 0.5)))


def plan(orchestration: Orchestration | None = ORCH) -> PlacementPlan:
    nodes = ("p0", "p1", "d0", "d1")
    return PlacementPlan(cluster="t", model="m", num_layers=8, method="thunderserve",
                         placements=tuple(NodePlacement(n, 0, 8) for n in nodes),
                         replicas=(Replica("prefill", ("p0",)), Replica("prefill", ("p1",)),
                                   Replica("decode", ("d0",)), Replica("decode", ("d1",))),
                         partial_inference=False, orchestration=orchestration)


def pair(decision: object) -> tuple[str, str]:
    route = decision.route  # type: ignore[attr-defined]
    prefill, decode = route.phases
    return prefill.hops[0].peer, decode.hops[0].peer


def test_tstp_routes_exactly_the_orchestrations_shares() -> None:
    s = make_scheduler("tstp", plan(), avg_output_len=10)
    assert isinstance(s, TstpScheduler) and scheduler_for(plan(), "tstp") == "tstp"
    counts = Counter(pair(s.submit(f"r{k}", 100, float(k))) for k in range(400))
    assert counts == {("p0", "d0"): 300, ("p1", "d0"): 50, ("p1", "d1"): 50}
    # Spread evenly: every window of 8 requests has 6 on p0 and 2 on p1.
    s2 = make_scheduler("tstp", plan(), avg_output_len=10)
    seq = [pair(s2.submit(f"r{k}", 100, 0.0))[0] for k in range(40)]
    assert all(seq[k:k + 8].count("p0") == 6 for k in range(0, 40, 8))


def test_tstp_bends_under_kv_pressure_instead_of_blocking() -> None:
    # d0 holds one request (100 prompt + 10 expected output); the orchestration sends 87.5% there.
    s = make_scheduler("tstp", plan(), avg_output_len=10, kv_capacity={"d0": 150, "d1": 10_000}, high_water=1.0)
    first = pair(s.submit("r0", 100, 0.0))
    assert first == ("p0", "d0")
    second = pair(s.submit("r1", 100, 0.0))
    assert second[1] == "d1"  # d0 is full: an open pair takes it
    s.finish("r0", 10, 1.0)
    assert pair(s.submit("r2", 100, 1.0))[1] == "d0"


def test_tstp_booked_at_the_handoff_keeps_the_orchestrations_pair_when_the_decode_replica_is_full() -> None:
    """decode_booking "handoff": d0's KV is charged only when a request's hand-off starts, so a full d0 does not
    bend the shares at admission; the second request waits for d0's room after its prefill instead."""
    s = make_scheduler("tstp", plan(), avg_output_len=10, kv_capacity={"d0": 150, "d1": 10_000}, high_water=1.0,
                       decode_booking="handoff")
    assert isinstance(s, TstpScheduler)
    assert pair(s.submit("r0", 100, 0.0)) == ("p0", "d0")
    assert pair(s.submit("r1", 100, 0.0)) == ("p0", "d0")
    s.prefilled("r0", 1.0)
    s.prefilled("r1", 1.0)
    assert s.take_handoffs() == ["r0"] and s.waiting_handoffs() == 1
    s.finish("r0", 10, 2.0)
    assert s.take_handoffs() == ["r1"]


def test_random_pairs_are_seeded_and_cover_every_pair() -> None:
    def run(seed: int) -> list[tuple[str, str]]:
        s = make_scheduler("random-pairs", plan(), avg_output_len=10, seed=seed)
        assert isinstance(s, RandomPairScheduler)
        return [pair(s.submit(f"r{k}", 100, 0.0)) for k in range(200)]

    assert run(3) == run(3) != run(4)
    counts = Counter(run(3))
    assert set(counts) == {(p, d) for p in ("p0", "p1") for d in ("d0", "d1")}
    assert all(35 <= c <= 65 for c in counts.values())  # 50 each in expectation, seeded: a fixed draw


def test_tstp_needs_an_orchestration_that_fits_the_plan() -> None:
    with pytest.raises(ConfigError, match="orchestration"):
        make_scheduler("tstp", plan(None))
    with pytest.raises(ConfigError, match="orchestration"):
        make_scheduler("tstp", plan(replace(ORCH, prefill_share=(1.0,))))


def test_the_simulator_routes_with_the_same_object() -> None:
    from hetnode.testnet.sim.runner import SimOptions, make_runtime_scheduler

    s = make_runtime_scheduler("tstp", plan(), {}, seed=0, avg_output_len=10, kv_capacity={},
                               options=SimOptions())
    runtime = make_scheduler("tstp", plan(), avg_output_len=10, kv_capacity={}, seed=0, regions={})
    assert type(s) is type(runtime)
    assert [pair(s.submit(f"r{k}", 100, 0.0)) for k in range(24)] == \
        [pair(runtime.submit(f"r{k}", 100, 0.0)) for k in range(24)]
