"""The decode KV booked when a request's hand-off starts (the phase-split schedulers' decode_booking "handoff",
ThunderServe's KV queues on the prefill replicas) in the simulator: the prefill hops keep the KV until the decode
hops have reserved, a hand-off that finds no room waits (never fails), more requests decode at once than when
the decode KV is booked at admission, and every block is freed at the end."""

from __future__ import annotations

from typing import Any

import pytest
from sim_helpers import PROFILES, TOY, keep_nodes
from test_sim_handoff import RATES, cluster

from hetnode.coordinator.split_scheduler import SplitScheduler
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.testnet.sim import SimOptions, Workload, simulate
from hetnode.testnet.sim.node import SimNode


def placement() -> PlacementPlan:
    return PlacementPlan(cluster="split", model="toy", num_layers=4, method="split",
                         placements=tuple(NodePlacement(n, *r) for n, r in
                                          (("p0", (0, 4)), ("p1", (0, 4)), ("d0", (0, 2)), ("d1", (2, 4)))),
                         replicas=(Replica("prefill", ("p0",)), Replica("prefill", ("p1",)),
                                   Replica("decode", ("d0", "d1"))))


def spec() -> Any:
    """Fast links between the nodes (2.5 Gbit/s, 2 ms): a hand-off costs little beside a decode."""
    fast = 3.2e8, 0.002
    return cluster(["p0", "p1", "d0", "d1"], [(a, b, *fast) for a in ("p0", "p1") for b in ("d0", "d1")]
                   + [("d0", "d1", *fast)])


def burst(n: int = 40) -> Workload:
    """Long prompts and short outputs arriving at once: a prompt's prefill takes about as long as its decode, so
    the prefill side queues, and the decode replica's KV (about three requests) binds."""
    return Workload(name="burst", inputs=tuple(2400 + 37 * (i % 7) for i in range(n)),
                    outputs=tuple(4 + i % 3 for i in range(n)), arrivals=tuple(0.01 * i for i in range(n)))


def run(booking: str, wl: Workload, nodes: list[SimNode] | None = None, **options: Any) -> Any:
    opts = SimOptions(**{"kv_codec": "fp16", "kv_codec_rates": RATES, "decode_booking": booking,
                         "kv_capacity": {"p0": 20_000, "p1": 20_000, "d0": 9_000, "d1": 9_000}, **options})
    return simulate(spec(), TOY, PROFILES, placement(), workload=wl, duration_s=200.0, warmup_s=0.0, options=opts,
                    scheduler="cls")


def decoding(result: Any) -> float:
    """How many requests decode at once, on average over the run (each from its first decode step to its end)."""
    rs = result.requests
    span = max(r.finish for r in rs) - min(r.arrival for r in rs)
    return sum(r.finish - (r.first_token + r.handoff) for r in rs) / span


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> list[SimNode]:
    return keep_nodes(monkeypatch)


def test_booked_at_the_handoff_every_request_is_served_and_every_block_freed(kept: list[SimNode]) -> None:
    wl = burst()
    result = run("handoff", wl)
    again = run("handoff", wl)
    a, b = (r.to_json(requests=True) for r in (result, again))
    a["run"] = b["run"] = None
    assert a == b  # deterministic
    assert result.summary["requests"]["finished"] == len(wl.inputs)
    assert all(r.generated == r.output_len and not r.rejected for r in result.requests)
    kv = result.summary["kv_handoff"]
    assert kv["refused_full"] == 0 and kv["handoffs_booked"] == len(wl.inputs)
    assert len(kept) == 8
    for node in kept:
        assert node.ledger.used == 0 and not node.kv_coming and not node.kv_held and not node.kv_first, node.name
        assert 0 < node.kv_peak <= node.ledger.capacity, node.name  # the ledger never went over its pool
    for r in result.requests:  # the decode KV was booked after the prefill, not at admission
        assert r.admitted < r.first_token <= r.decode_booked < r.first_token + r.handoff < r.finish


def test_a_full_decode_replica_makes_handoffs_wait_and_more_decode_at_once_than_booked_at_admission() -> None:
    wl = burst()
    admission, handoff = run("admission", wl), run("handoff", wl)
    for result in (admission, handoff):
        assert result.summary["requests"]["finished"] == len(wl.inputs)
    # At admission, the decode KV is booked for requests still waiting on the prefill replicas.
    assert all(r.decode_booked == r.admitted for r in admission.requests)
    waited = [r for r in handoff.requests if r.decode_booked - r.first_token > 0.05]
    assert waited  # hand-offs that waited on their prefill replica for the decode replica's room ...
    assert all(r.finish > r.decode_booked for r in waited)  # ... and completed once it freed
    # Booked at admission, about a third of the decode replica's room is held by prompts still being prefilled
    # (1.44 decoding of about 2.9 holding it); booked at the hand-off, 2.11 (the hand-off's own time is the rest).
    assert decoding(handoff) > 1.2 * decoding(admission)
    assert max(r.finish for r in handoff.requests) < max(r.finish for r in admission.requests)


def test_the_scheduler_and_the_nodes_agree_on_the_booking() -> None:
    """The setting is the scheduler's: an object built with it drives the simulator the same as the option."""
    wl = burst(12)
    plan = placement()
    sched = SplitScheduler(plan, kv_capacity={"p0": 20_000, "p1": 20_000, "d0": 9_000, "d1": 9_000},
                           avg_output_len=5.0, decode_booking="handoff")
    opts = SimOptions(kv_codec="fp16", kv_codec_rates=RATES,
                      kv_capacity={"p0": 20_000, "p1": 20_000, "d0": 9_000, "d1": 9_000})
    result = simulate(spec(), TOY, PROFILES, plan, workload=wl, duration_s=200.0, warmup_s=0.0, options=opts,
                      scheduler=sched)
    assert result.summary["kv_handoff"]["handoffs_booked"] == 12
    assert sched.running == 0 and sched.waiting_handoffs() == 0
    assert all(e.tokens == 0 and e.requests == 0 for e in sched.kv_estimate().values())


def test_a_decode_hop_without_room_at_the_handoff_waits_for_it_instead_of_failing(kept: list[SimNode]) -> None:
    """The scheduler believes the decode nodes hold 20,000 tokens each (a stale estimate); their real pools hold
    about three requests. Booked at admission, such an Install is refused ("full") and the request moves; booked at
    the hand-off, the decode hop's reservation waits for a release, and every request is served once."""
    wl = burst(12)
    plan = placement()
    believed = {"p0": 20_000, "p1": 20_000, "d0": 20_000, "d1": 20_000}
    sched = SplitScheduler(plan, kv_capacity=believed, avg_output_len=5.0, decode_booking="handoff")
    opts = SimOptions(kv_codec="fp16", kv_codec_rates=RATES,
                      kv_capacity={"p0": 20_000, "p1": 20_000, "d0": 8_000, "d1": 8_000})
    result = simulate(spec(), TOY, PROFILES, plan, workload=wl, duration_s=200.0, warmup_s=0.0, options=opts,
                      scheduler=sched)
    kv = result.summary["kv_handoff"]
    assert kv["reservations_waited"] > 0 and kv["refused_full"] == 0
    assert kv["installs"] == 2 * len(wl.inputs)  # one per decode hop and request: nothing was retried
    assert result.summary["requests"]["finished"] == len(wl.inputs)
    assert all(r.generated == r.output_len and not r.rejected for r in result.requests)
    assert sched.running == 0 and sched.waiting_handoffs() == 0
    for node in kept:
        assert node.ledger.used == 0 and not node.kv_coming and not node.kv_held and not node.kv_first, node.name
        assert node.kv_peak <= node.ledger.capacity, node.name
