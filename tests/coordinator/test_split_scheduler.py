"""CLS routing over a phase-split plan: join-the-shortest-queue on pending tokens, decode in the prefill
replica's region first, the KV mask on both sides, the FIFO queue, nodes going down."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetnode.coordinator.routing import make_scheduler, scheduler_for
from hetnode.coordinator.split_scheduler import SplitScheduler
from hetnode.errors import ConfigError
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.protocol.routes import route_problem

REGIONS = {"pa": "us", "pb": "eu", "da1": "us", "da2": "us", "db": "eu"}


def split_plan() -> PlacementPlan:
    """Prefill: pa (us), pb (eu), one stage each. Decode: da1 -> da2 (us, two stages), db (eu)."""
    ranges = {"pa": (0, 8), "pb": (0, 8), "da1": (0, 3), "da2": (3, 8), "db": (0, 8)}
    return PlacementPlan(cluster="t", model="m", num_layers=8, method="split",
                         placements=tuple(NodePlacement(n, *r) for n, r in ranges.items()),
                         replicas=(Replica("prefill", ("pa",)), Replica("prefill", ("pb",)),
                                   Replica("decode", ("da1", "da2")), Replica("decode", ("db",))),
                         partial_inference=False)


def sched(kv: dict[str, int] | None = None, **kw: object) -> SplitScheduler:
    s = make_scheduler("cls", split_plan(), kv_capacity=kv or {}, regions=REGIONS, avg_output_len=100, **kw)
    assert isinstance(s, SplitScheduler)
    return s


def picks(decision: object) -> tuple[str, str]:
    route = decision.route  # type: ignore[attr-defined]
    assert route is not None and route_problem(route, 8) == ""
    prefill, decode = route.phases
    assert (prefill.kind, decode.kind) == ("prefill", "decode")
    return prefill.hops[0].peer, decode.hops[0].peer


def test_shortest_queue_on_pending_prompt_tokens_and_decode_in_the_same_region() -> None:
    s = sched()
    assert picks(s.submit("r1", 500, 0)) == ("pa", "da1")  # ties go to the plan's first replica
    assert picks(s.submit("r2", 100, 0)) == ("pb", "db")  # pa has 500 pending; eu's decode replica with it
    assert picks(s.submit("r3", 100, 0)) == ("pb", "db")  # 100 < 500 pending
    s.prefilled("r1", 1)  # pa's prompt is done: it has nothing pending any more
    assert picks(s.submit("r4", 100, 1)) == ("pa", "da1")


def test_decode_goes_to_another_region_only_when_its_own_has_no_room() -> None:
    s = sched({"pa": 10_000, "pb": 10_000, "da1": 1000, "da2": 1000, "db": 10_000}, high_water=1.0)
    assert picks(s.submit("r1", 600, 0)) == ("pa", "da1")  # 600 + 100 expected output fit da1's 1000
    s.prefilled("r1", 0)
    assert picks(s.submit("r2", 250, 0)) == ("pa", "db")  # da1 would reach 700 + 350 > 1000: eu's


def test_a_request_waits_for_room_and_starts_when_a_request_finishes() -> None:
    s = sched({"pa": 1000, "pb": 1000, "da1": 1000, "da2": 1000, "db": 1000}, high_water=1.0)
    assert s.submit("r1", 800, 0).assigned
    assert s.submit("r2", 800, 0).assigned
    d = s.submit("r3", 800, 0)
    assert d.queued and s.queue_len == 1
    assert s.prefilled("r1", 1) == []  # the prefill side has room now, but no decode replica does
    started = s.finish("r1", 100, 2)
    assert [x.request_id for x in started] == ["r3"] and started[0].assigned and started[0].waited_s == 2
    assert s.queue_len == 0 and s.running == 2


def test_too_large_and_unservable() -> None:
    s = sched({"pa": 1000, "pb": 1000, "da1": 5000, "da2": 5000, "db": 5000})
    d = s.submit("big", 1200, 0)
    assert d.rejected and d.too_large and "prompt of 1200 tokens" in d.reason
    assert s.largest_kv == 1000
    for n in ("da1", "db"):
        s.node_down(n)
    d = s.submit("r", 10, 0)
    assert d.rejected and not d.too_large and "no decode replica" in d.reason
    assert s.largest_kv == float("-inf")


def test_node_down_affects_the_phases_a_request_still_has_to_run() -> None:
    s = sched()
    picks(s.submit("r1", 100, 0))  # pa, da1 -> da2
    picks(s.submit("r2", 200, 0))  # pb, db
    s.prefilled("r2", 1)
    assert s.node_down("pa").affected == ("r1",)  # still prefilling there
    assert s.node_down("pb").affected == ()  # r2's prefill is done: its KV is on db already
    assert s.node_down("da2").affected == ("r1",)
    d = s.submit("r3", 10, 2)
    assert d.rejected and "no prefill replica" in d.reason


def test_make_scheduler_routes_split_plans_by_cls_only() -> None:
    plan = split_plan()
    assert scheduler_for(plan, "iwrr") == "cls"
    with pytest.raises(ConfigError, match="phase-split"):
        make_scheduler("iwrr", plan)
    with pytest.raises(ConfigError, match="phase-split"):
        make_scheduler("cls", PlacementPlan(cluster="t", model="m", num_layers=8, method="given",
                                            placements=(NodePlacement("a", 0, 8),)))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["submit", "prefilled", "handed", "finish", "cancel"]), st.integers(0, 7),
                          st.integers(1, 900)), max_size=40), st.sampled_from(["admission", "handoff"]))
def test_the_estimate_returns_to_zero_and_limits_hold(ops: list[tuple[str, int, int]], booking: str) -> None:
    kv = {"pa": 2000, "pb": 1500, "da1": 3000, "da2": 2500, "db": 2000}
    s = sched(kv, high_water=0.9, queue_limit=4, decode_booking=booking)
    now = 0.0
    running: set[str] = set()
    prefilled: set[str] = set()
    for op, i, n in ops:
        now += 1
        rid = f"r{i}"
        decisions = []
        if op == "submit" and rid not in running and s.pipeline_of(rid) is None:
            try:
                d = s.submit(rid, n, now)
            except ValueError:
                continue  # already queued
            decisions = [d]
        elif op == "prefilled":
            decisions = s.prefilled(rid, now)
            prefilled |= {rid} & running
        elif op == "handed":
            decisions = s.partial_done(rid, now)
        elif op == "finish" and rid in running:
            decisions = s.finish(rid, 100, now)  # the mean output stays put: the mask's bound is exact
            running.discard(rid)
        elif op == "cancel":
            decisions = s.cancel(rid, now)
            running.discard(rid)
        running |= {d.request_id for d in decisions if d.assigned}
        prefilled &= running
        handoffs = s.take_handoffs()
        assert set(handoffs) <= prefilled and len(set(handoffs)) == len(handoffs)
        if booking == "admission":
            assert handoffs == []
        for node, est in s.kv_estimate().items():
            assert est.capacity is not None and est.tokens <= 0.9 * est.capacity + 1e-6, (node, est)
    for rid in sorted(running):
        s.finish(rid, 10, now + 1)
    for rid in [f"r{i}" for i in range(8)]:
        s.cancel(rid, now + 2)
    assert s.running == 0 and s.queue_len == 0 and s.waiting_handoffs() == 0
    assert all(abs(e.tokens) < 1e-6 and e.requests == 0 for e in s.kv_estimate().values())
    assert all(p == 0 for _, _, p in s.pending())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["submit", "prefilled", "handed", "finish", "cancel"]), st.integers(0, 7),
                          st.integers(1, 900)), max_size=40))
def test_booking_at_admission_is_the_default_and_decides_as_before(ops: list[tuple[str, int, int]]) -> None:
    """decode_booking "admission" named or not: the same decisions, step by step (partial_done changes nothing)."""
    kv = {"pa": 2000, "pb": 1500, "da1": 3000, "da2": 2500, "db": 2000}
    a, b = sched(kv, queue_limit=4), sched(kv, queue_limit=4, decode_booking="admission")
    assert a.decode_booking == "admission"
    for k, (op, i, n) in enumerate(ops):
        rid, now = f"r{i}", float(k)
        out = []
        for s in (a, b):
            try:
                if op == "submit":
                    out.append([s.submit(rid, n, now)])
                elif op == "prefilled":
                    out.append(s.prefilled(rid, now))
                elif op == "handed":
                    out.append(s.partial_done(rid, now))
                elif op == "finish":
                    out.append(s.finish(rid, 100, now))
                else:
                    out.append(s.cancel(rid, now))
            except (KeyError, ValueError) as exc:
                out.append([type(exc).__name__])
        assert out[0] == out[1]
        assert a.kv_estimate() == b.kv_estimate()
        if op == "handed":
            assert out[0] == []
        assert b.take_handoffs() == []


def test_booked_at_the_handoff_admission_is_the_prefill_sides_and_handoffs_wait_in_fifo_order() -> None:
    kv = {"pa": 10_000, "pb": 10_000, "da1": 1000, "da2": 1000, "db": 1000}
    s = sched(kv, high_water=1.0, decode_booking="handoff")
    assert picks(s.submit("r1", 800, 0)) == ("pa", "da1")
    assert picks(s.submit("r2", 800, 0)) == ("pb", "db")
    # Both decode replicas are spoken for; booked at admission r3 would queue. Here the prefill side has room.
    assert picks(s.submit("r3", 800, 0)) == ("pa", "da1")
    assert s.queue_len == 0 and s.take_handoffs() == []
    assert s.kv_estimate()["da1"].tokens == 0  # nothing charged on the decode side before a hand-off
    s.prefilled("r1", 1)
    assert s.take_handoffs() == ["r1"]  # da1 has room: its hand-off may start
    assert s.kv_estimate()["da1"].tokens == 900 and s.kv_estimate()["pa"].tokens == 1600
    s.prefilled("r3", 2)
    assert s.take_handoffs() == [] and s.waiting_handoffs() == 1  # da1 is full: r3's KV waits on pa
    assert s.pipeline_of("r3") is not None
    s.partial_done("r1", 3)  # r1's KV has left pa
    assert s.kv_estimate()["pa"].tokens == 800
    assert s.finish("r1", 100, 4) == [] and s.take_handoffs() == ["r3"]  # room again: r3's turn
    s.partial_done("r3", 5)
    assert s.kv_estimate()["pa"].tokens == 0 and s.kv_estimate()["da1"].tokens == 900
    # A request waiting for its hand-off leaves the FIFO when it is cancelled.
    s.prefilled("r2", 6)
    assert s.take_handoffs() == ["r2"]
    assert picks(s.submit("r4", 800, 7)) == ("pa", "da1")  # pa's and pb's prompts are all prefilled: a tie
    s.prefilled("r4", 8)
    assert s.take_handoffs() == [] and s.waiting_handoffs() == 1  # behind r3 on da1
    s.cancel("r4", 9)
    assert s.waiting_handoffs() == 0 and s.finish("r3", 100, 10) == [] and s.take_handoffs() == []
    s.finish("r2", 100, 11)
    assert s.running == 0
    assert all(e.tokens == 0 and e.requests == 0 for e in s.kv_estimate().values())


def test_booked_at_the_handoff_a_decode_replica_too_small_for_the_request_is_never_picked() -> None:
    kv = {"pa": 10_000, "pb": 10_000, "da1": 500, "da2": 500, "db": 2000}
    s = sched(kv, high_water=1.0, decode_booking="handoff")
    assert picks(s.submit("r1", 800, 0)) == ("pa", "db")  # da1 could never hold 900 tokens
    with pytest.raises(ConfigError, match="decode_booking"):
        sched(kv, decode_booking="later")
