"""Splitwise's pools over a phase-split plan: a pool that is overloaded borrows from the mixed pool, then from the
other pool (whose replica becomes mixed), a mixed replica goes home once the borrowed work has drained, and one
that stays mixed long is re-purposed."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetnode.coordinator.pool_scheduler import PoolScheduler
from hetnode.coordinator.routing import make_scheduler, scheduler_for
from hetnode.errors import ConfigError
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.protocol.routes import route_problem

L = 8


def pool_plan() -> PlacementPlan:
    """Prefill: p1, p2. Decode: d1, d2. Every replica one node holding the whole model."""
    return PlacementPlan(cluster="t", model="m", num_layers=L, method="split",
                         placements=tuple(NodePlacement(n, 0, L) for n in ("p1", "p2", "d1", "d2")),
                         replicas=(Replica("prefill", ("p1",)), Replica("prefill", ("p2",)),
                                   Replica("decode", ("d1",)), Replica("decode", ("d2",))),
                         partial_inference=False)


def sched(kv: dict[str, int] | None = None, **kw: object) -> PoolScheduler:
    s = make_scheduler("splitwise", pool_plan(), kv_capacity=kv or {}, avg_output_len=100, high_water=1.0, **kw)
    assert isinstance(s, PoolScheduler)
    return s


def picks(decision: object) -> tuple[str, str]:
    """(prefill node, decode node): the same node twice for one mixed pipeline."""
    route = decision.route  # type: ignore[attr-defined]
    assert route is not None and route_problem(route, L) == ""
    if len(route.phases) == 1:
        assert route.phases[0].kind == "mixed"
        return route.phases[0].hops[0].peer, route.phases[0].hops[0].peer
    prefill, decode = route.phases
    return prefill.hops[0].peer, decode.hops[0].peer


def pools(s: PoolScheduler) -> dict[str, str]:
    return {nodes[0]: pool for _, pool, nodes in s.pools()}


def test_under_the_threshold_it_routes_as_cls() -> None:
    s = sched(prefill_queue_tokens=1000)
    assert picks(s.submit("r1", 400, 0)) == ("p1", "d1")
    assert picks(s.submit("r2", 400, 0)) == ("p2", "d2")
    assert picks(s.submit("r3", 100, 0)) == ("p1", "d1")  # 400 pending on each: ties to the first
    assert pools(s) == {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}
    assert s.moved_to_mixed == 0


def test_a_full_prefill_pool_lends_a_decode_replica_which_then_runs_the_request_whole() -> None:
    s = sched(prefill_queue_tokens=1000)
    assert picks(s.submit("r1", 900, 0)) == ("p1", "d1")
    assert picks(s.submit("r2", 900, 0)) == ("p2", "d2")
    # Both prefill queues would pass 1000 tokens: the decode replica with the shortest queue joins the mixed
    # pool, prefills the prompt and decodes it too (no KV moves).
    assert picks(s.submit("r3", 200, 0)) == ("d1", "d1")
    assert pools(s)["d1"] == "mixed" and s.moved_to_mixed == 1
    assert picks(s.submit("r4", 200, 0)) == ("d1", "d1")  # the mixed pool first, while it stays under
    s.prefilled("r3", 1)
    assert pools(s)["d1"] == "mixed"  # r4's prompt is still there
    s.prefilled("r4", 1)
    assert pools(s)["d1"] == "decode"  # no prompt left: back home (its decodes are its own kind of work)
    # p1 and p2 are still over the threshold: the decode replica with the shorter queue (d2: r2 against d1's
    # r1, r3 and r4) is lent now.
    assert picks(s.submit("r5", 200, 2)) == ("d2", "d2")
    assert s.moved_to_mixed == 2


def test_a_full_decode_pool_lends_a_prefill_replica() -> None:
    s = sched({"p1": 10_000, "p2": 10_000, "d1": 1000, "d2": 1000})
    assert picks(s.submit("r1", 800, 0)) == ("p1", "d1")
    assert picks(s.submit("r2", 800, 0)) == ("p2", "d2")
    # No decode replica has room for 300 + 100: p1 (shortest prefill queue once r1 is prefilled) lends itself.
    s.prefilled("r1", 0)
    assert picks(s.submit("r3", 300, 0)) == ("p1", "p1")
    assert pools(s)["p1"] == "mixed"
    s.finish("r3", 100, 1)
    assert pools(s)["p1"] == "prefill"
    assert s.kv_estimate()["p1"].tokens == pytest.approx(0)


def test_a_replica_that_stays_mixed_is_repurposed() -> None:
    s = sched({"p1": 10_000, "p2": 10_000, "d1": 1000, "d2": 1000}, repurpose_after_s=30)
    s.submit("r1", 800, 0)
    s.submit("r2", 800, 0)
    s.prefilled("r1", 0)
    s.prefilled("r2", 0)
    assert picks(s.submit("r3", 300, 0)) == ("p1", "p1")  # lent at t=0
    # At t=40 p1 has been mixed for 40 s: re-purposed, its home is decode now. The prompt of r3 it still holds
    # is work of its old kind, so it stays mixed until that has drained. r4's prompt goes to the prefill pool
    # (p2), its decode to the mixed p1 (the decode pool has no room).
    assert picks(s.submit("r4", 100, 40)) == ("p2", "p1")
    assert s.repurposed == 1 and pools(s)["p1"] == "mixed"
    s.prefilled("r3", 41)
    assert pools(s)["p1"] == "decode"
    assert [home for home, _, nodes in s.pools() if nodes == ("p1",)] == ["decode"]


def test_the_estimates_return_to_zero_whatever_the_order() -> None:
    @settings(max_examples=60, deadline=None)
    @given(st.lists(st.tuples(st.integers(1, 900), st.booleans()), min_size=1, max_size=30), st.integers(0, 2**16))
    def run(requests: list[tuple[int, bool]], seed: int) -> None:
        s = sched({"p1": 2000, "p2": 2000, "d1": 2000, "d2": 2000}, prefill_queue_tokens=1200,
                  repurpose_after_s=5)
        live: list[str] = []
        t = 0.0
        for n, (size, prefill_first) in enumerate(requests):
            t += 1
            rid = f"r{n}"
            decision = s.submit(rid, size, t)
            if decision.assigned:
                live.append(rid)
                if prefill_first:
                    s.prefilled(rid, t)
            elif decision.queued:
                live.append(rid)
            if len(live) > 3:
                done = live.pop(seed % len(live))
                if s.pipeline_of(done) is not None:
                    s.finish(done, 10, t)
                else:
                    s.cancel(done, t)
        for rid in live:
            s.cancel(rid, t + 1)
        assert all(kv.tokens == pytest.approx(0) for kv in s.kv_estimate().values())
        assert s.queue_len == 0
        assert {pool for _, pool, _ in s.pools()} <= {"prefill", "decode"}  # nothing left borrowed

    run()


def test_splitwise_routes_only_phase_split_plans() -> None:
    plan = pool_plan()
    assert scheduler_for(plan, "splitwise") == "splitwise"
    assert scheduler_for(plan, "iwrr") == "cls"
    helix = PlacementPlan(cluster="t", model="m", num_layers=L, method="helix",
                          placements=(NodePlacement("a", 0, L),), partial_inference=False)
    assert scheduler_for(helix, "splitwise") == "iwrr"  # the operator's choice applies to the plans it fits
    with pytest.raises(ConfigError, match="phase-split plan"):
        make_scheduler("splitwise", helix)
    with pytest.raises(ValueError, match="prefill_queue_tokens"):
        make_scheduler("splitwise", plan, prefill_queue_tokens=0)


def test_a_decode_queue_at_its_batch_threshold_lends_a_prefill_replica() -> None:
    s = sched(decode_batch=2)
    assert [picks(s.submit(f"r{i}", 10, 0))[1] for i in range(4)] == ["d1", "d2", "d1", "d2"]
    # Both decode replicas hold two requests: the fifth looks to the mixed pool (empty), then lends the prefill
    # replica with the shortest queue, which prefills it too (one mixed pipeline).
    assert picks(s.submit("r4", 10, 0)) == ("p1", "p1") and pools(s)["p1"] == "mixed" and s.moved_to_mixed == 1
    unbounded = sched()
    assert {picks(unbounded.submit(f"r{i}", 10, 0))[1] for i in range(6)} == {"d1", "d2"}
    with pytest.raises(ValueError, match="decode_batch"):
        sched(decode_batch=0)
