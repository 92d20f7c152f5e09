"""One phase-split plan, two executors: the runtime's coordinator (`Deployment`) and the simulated one
(`SimCoordinator`) route the same arrivals the same way.

Each side gets its own scheduler (CLS, or Splitwise's pools) for the same plan and runs the same script:
requests arrive at given times; once a request has its route, its prefill takes a given time (the first token:
the runtime's coordinator calls `route_prefilled`, the simulated one `scheduler.prefilled`), then its decode
another (the last token: the request ends). Both must give every request the same prefill and decode replicas at
the same moment: the same joins of the shortest queue, the same region preference, the same FIFO queueing while
the KV masks are full, the same admissions when a prefill or a request ends.

With the decode KV booked at the hand-off (decode_booking "handoff", ThunderServe's KV queues), each side also
takes the hand-offs the scheduler lets start after every event that can free KV (the runtime's `Deployment` calls
`on_handoff`, as its generator hears it; the simulated coordinator calls its installer's `pull`): from a hand-off's
start, the prefill hops are done with the request a given time later (HandedOver: `partial_done`) and the request
ends a given time later. Both must start every hand-off at the same moment, in the same order.
"""

from __future__ import annotations

import heapq
import itertools
import re
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_helpers import PROFILE

from hetnode.coordinator.deployment import Deployment, Plan, Shard
from hetnode.coordinator.registry import Registry
from hetnode.coordinator.routing import make_scheduler
from hetnode.ids import NodeId
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.protocol.messages import HardwareProfile, Join, Route
from hetnode.testnet.sim.coordinator import SimCoordinator, SimRequest, SimToken
from hetnode.testnet.sim.node import SimNode

REGIONS = {"p0": "us", "p1": "eu", "p2": "eu", "d0": "us", "d1": "eu", "d2": "us", "d3": "eu"}
# Two prefill replicas (p0 alone; p1 and p2 chained) and three decode ones (d1 chained with d3), over two
# regions; every node's KV holds 600 tokens, so a few requests fill a replica and the rest queue.
PLACEMENT = PlacementPlan(
    cluster="mirror", model="tiny", num_layers=4, method="split",
    placements=(NodePlacement("p0", 0, 4), NodePlacement("p1", 0, 2), NodePlacement("p2", 2, 4),
                NodePlacement("d0", 0, 4), NodePlacement("d1", 0, 1), NodePlacement("d3", 1, 4),
                NodePlacement("d2", 0, 4)),
    replicas=(Replica("prefill", ("p0",)), Replica("prefill", ("p1", "p2")), Replica("decode", ("d0",)),
              Replica("decode", ("d1", "d3")), Replica("decode", ("d2",))))
KV = {p.node: 600 for p in PLACEMENT.placements}
OPTIONS: dict[str, Any] = {"kv_capacity": KV, "high_water": 0.9, "avg_output_len": 100.0, "queue_limit": 8,
                           "regions": REGIONS}

# Arrival, prompt tokens, prefill seconds, decode seconds; and with "handoff" the seconds from a hand-off's start
# to the prefill hops' HandedOver (shorter than the decode's: the request ends decode seconds after the start).
Request = tuple[float, int, float, float] | tuple[float, int, float, float, float]
# Request -> (when it got its route, the route, when its hand-off started: -1 when booked at admission), or why not.
Outcome = dict[str, tuple[float, str, float] | str]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama")


def _route(route: Route) -> str:
    return " | ".join(">".join(h.peer for h in phase.hops) for phase in route.phases)


def _options(booking: str, policy: str) -> dict[str, Any]:
    return OPTIONS if booking == "admission" else {**OPTIONS, "decode_booking": booking}


async def _runtime(model: Path, script: list[Request], policy: str, booking: str = "admission") -> Outcome:
    """The coordinator's Deployment with the plan installed and ready, driven on trio's mock clock."""
    registry = Registry(token="t", heartbeat_deadline_s=1e9)
    profile = HardwareProfile(device="cpu", device_type="cpu", memory_bytes=8 << 30, matmul_tflops=0.1,
                              mem_bandwidth_gbps=10.0, dtype="float32")
    for name in REGIONS:
        assert registry.admit(NodeId(name), Join(token="t", name=name, profile=profile, listen_addrs=[]),
                              now=trio.current_time(), wall=time.time()).admitted

    async def no_control(*args: Any) -> None:
        raise AssertionError("no assignments here")

    deployment = Deployment(registry, no_control, model=str(model), model_config=load_config(model),  # type: ignore[arg-type]
                            coordinator=NodeId("coord"))
    shards = [Shard(p.node, p.first_layer, p.last_layer) for p in PLACEMENT.placements]
    scheduler = make_scheduler(policy, PLACEMENT, **_options(booking, policy))
    plan = Plan(1, shards, [s.peer for s in shards], "test", 0.0, PLACEMENT, scheduler)
    plan.ready = {NodeId(s.peer) for s in shards}
    deployment.plan = deployment.serving = plan
    out: Outcome = {}
    started: dict[str, float] = {}
    handoff: dict[str, trio.Event] = {}

    def on_handoff(key: str) -> None:  # as the generator hears it: the decode hops reserve, the KV goes
        started[key] = trio.current_time()
        handoff.setdefault(key, trio.Event()).set()

    deployment.on_handoff = on_handoff

    async def handed(key: str, at: float) -> None:
        await trio.sleep_until(at)
        deployment.route_partial_done(key)  # the prefill hops' HandedOver

    async def one(i: int, at: float, input_len: int, prefill_s: float, decode_s: float, handoff_s: float = 0.0,
                  ) -> None:
        await trio.sleep_until(at)
        key = f"r{i}"
        try:
            route = await deployment.route(key, input_len)
        except Exception as exc:  # the scheduler refused it
            out[key] = type(exc).__name__
            return
        admitted = trio.current_time()
        await trio.sleep(prefill_s)
        deployment.route_prefilled(key)  # its first token
        if booking == "handoff":
            await handoff.setdefault(key, trio.Event()).wait()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(handed, key, started[key] + handoff_s)
                await trio.sleep_until(started[key] + decode_s)
        else:
            await trio.sleep(decode_s)
        out[key] = (admitted, _route(route), started.get(key, -1.0))
        deployment.route_done(key, 2)  # its last

    # (In virtual time: a hand-off the runtime never starts fails the test instead of hanging it.)
    with trio.fail_after(1e5):
        async with trio.open_nursery() as nursery:
            for i, request in enumerate(script):
                nursery.start_soon(one, i, *request)
    shown = plan.to_json()  # GET /v1/plan
    assert shown["scheduler"]["name"] == policy  # type: ignore[index]
    replicas = shown["replicas"]
    assert isinstance(replicas, list) and len(replicas) == len(PLACEMENT.replicas)
    if policy == "splitwise":  # every request ended: every replica is back in its (possibly new) home pool
        assert all(r["pool"] == r["home"] for r in replicas)
    return out


def _sim(script: list[Request], policy: str, booking: str = "admission") -> Outcome:
    """SimCoordinator with stand-ins for the network: the route's hops are ready at once, its prefill and decode
    take the script's times (a tiny event loop of its own)."""
    events: list[tuple[float, int, Any]] = []
    seq = itertools.count()
    durations = {f"r{i}": (req[2], req[3], req[4] if len(req) > 4 else 0.0) for i, req in enumerate(script)}
    admitted: dict[str, tuple[float, str]] = {}
    started: dict[str, float] = {}
    nodes = [SimNode(i, name, "x", PROFILE, p.first_layer, p.last_layer, kv_capacity_tokens=600, block_size=16,
                     max_batch_tokens=512, window=(0.0, 1e9), bin_s=1.0)
             for i, (name, p) in enumerate((p.node, p) for p in PLACEMENT.placements)]
    out: Outcome = {}

    def send(src: int, dst: int, items: list[Any], now: float) -> None:
        if dst == coord.index:
            coord.on_message(items, now)
            return
        (r,) = items  # the context: the route runs it
        admitted[r.rid] = (now, re.sub(r"\[\d+,\d+\)", "", r.path))  # the nodes of each phase
        prefill_s, decode_s, _ = durations[r.rid]
        heapq.heappush(events, (now + prefill_s, next(seq), SimToken(r)))
        if not r.pull:
            heapq.heappush(events, (now + prefill_s + decode_s, next(seq), SimToken(r)))

    class Ready:
        def install(self, r: SimRequest, now: float) -> None:
            r.ready = 1
            coord.on_ready(r, r.session, now)

        def queue(self, r: SimRequest, now: float) -> None:  # booked at the hand-off: the context goes at once
            r.pull = True

        def pull(self, r: SimRequest, now: float) -> None:  # the hand-off may start: the decode hops are ready
            started[r.rid] = now
            self.install(r, now)

        def push(self, r: SimRequest, now: float) -> None:  # every decode hop is ready: the KV goes
            _, decode_s, handoff_s = durations[r.rid]
            assert r.handoff is not None
            for _ in r.handoff.sources:  # each prefill hop's HandedOver
                heapq.heappush(events, (now + handoff_s, next(seq), ("handed", r)))
            heapq.heappush(events, (now + decode_s, next(seq), SimToken(r)))

        def reprefills(self, route: Any, tokens: int) -> bool:
            return False  # no node has measured a prefill rate here, as on the runtime's side

    coord = SimCoordinator(make_scheduler(policy, PLACEMENT, **_options(booking, policy)), nodes, num_layers=4,
                           send=send, send_ids=lambda *a: None, release=lambda *a: None, block_size=16,
                           window=(0.0, 1e9), bin_s=1.0, handoff=Ready())
    requests = [SimRequest(i, req[0], req[1], 2) for i, req in enumerate(script)]
    for r in requests:
        heapq.heappush(events, (r.arrival, next(seq), r))
    while events:
        now, _, what = heapq.heappop(events)
        if isinstance(what, SimRequest):
            coord.arrive(what, now)
        elif isinstance(what, tuple):
            coord.on_handed(what[1], what[1].session, now)
        else:
            coord.on_message([what], now)
    out: Outcome = {}
    for r in requests:
        if r.rejected:
            out[r.rid] = "GenerationError"
        else:
            out[r.rid] = (*admitted[r.rid], started.get(r.rid, -1.0))
    return out


def _check(model: Path, script: list[Request], name: str, booking: str = "admission") -> Outcome:
    runtime = trio.run(_runtime, model, script, name, booking, clock=trio.testing.MockClock(autojump_threshold=0))
    sim = _sim(script, name, booking)
    assert sim.keys() == runtime.keys()
    for key, got in runtime.items():
        want = sim[key]
        if isinstance(got, str) or isinstance(want, str):
            assert got == want, key
        else:
            assert got[1] == want[1], key
            assert got[0] == pytest.approx(want[0], abs=1e-9), key
            assert got[2] == pytest.approx(want[2], abs=1e-9), key  # the hand-off's start
    return runtime


@pytest.mark.parametrize("name", ["cls", "splitwise"])
def test_the_same_replicas_at_the_same_moments_with_queueing(tiny_model: Path, name: str) -> None:
    # Four long prompts fill the decode replicas' KV masks; the rest queue and go in order as requests end.
    # (Nudged apart so that no two events fall on one instant: the two executors need not order such ties alike,
    # and the pools' state depends on the order.)
    script: list[Request] = [(0.1 * i + i * 1e-6, 150 + 37 * (i % 5), 0.5 + 0.1 * (i % 3) + i * 1e-7,
                              2.0 + 0.7 * (i % 4) + i * 1e-8) for i in range(14)]
    out = _check(tiny_model, script, name)
    routes = {v[1] for v in out.values() if not isinstance(v, str)}
    assert {"p0 | d0", "p1>p2 | d1>d3"} <= routes  # both regions, each preferring its own
    if name == "splitwise":  # the decode pool fills: prefill replicas are lent and run requests whole
        assert routes & {"p0", "p1>p2"}
    started = [v[0] for v in out.values() if not isinstance(v, str)]
    assert any(t > 0.1 * 14 for t in started)  # some waited in the queue
    refused = any(isinstance(v, str) for v in out.values())
    # CLS's queue bound refused some; the pools lent replicas across roles instead and refused none.
    assert refused == (name == "cls")


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 500), st.integers(1, 30), st.integers(1, 60)),
                min_size=1, max_size=16), st.sampled_from(["cls", "splitwise"]))
def test_random_scripts_route_the_same(tiny_model: Path, draws: list[tuple[int, int, int, int]], name: str) -> None:
    # Times on a grid of distinct primes-ish steps, so that no two events of a script fall on the same instant.
    at = 0.0
    script: list[Request] = []
    for i, (gap, input_len, prefill, decode) in enumerate(draws):
        at += gap * 0.0137
        script.append((at, input_len, prefill * 0.0311 + i * 1e-6, decode * 0.0529 + i * 1e-7))
    _check(tiny_model, script, name)


@pytest.mark.parametrize("name", ["cls", "random-pairs"])
def test_hand_offs_booked_when_they_start_start_at_the_same_moments(tiny_model: Path, name: str) -> None:
    # The same long prompts: admission now waits only for the prefill replicas' room; the decode replicas' KV
    # (about three requests each) makes prefilled requests wait for their hand-off, in FIFO order per replica.
    script: list[Request] = [(0.1 * i + i * 1e-6, 150 + 37 * (i % 5), 0.5 + 0.1 * (i % 3) + i * 1e-7,
                              2.0 + 0.7 * (i % 4) + i * 1e-8, 0.2 + 0.05 * (i % 3) + i * 1e-9) for i in range(14)]
    out = _check(tiny_model, script, name, "handoff")
    ran = [v for v in out.values() if not isinstance(v, str)]
    assert all(v[2] >= 0 for v in ran)  # every hand-off was started by the scheduler
    # Some waited past their first token for the decode replica's room (the prefill hops kept their KV).
    prefilled = {k: v[0] + script[int(k[1:])][2] for k, v in out.items() if not isinstance(v, str)}
    assert any(v[2] > prefilled[k] + 1e-6 for k, v in out.items() if not isinstance(v, str))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 500), st.integers(1, 30), st.integers(1, 60),
                          st.integers(1, 20)), min_size=1, max_size=16), st.sampled_from(["cls", "random-pairs"]))
def test_random_scripts_start_their_hand_offs_the_same(tiny_model: Path, draws: list[tuple[int, int, int, int, int]],
                                                       name: str) -> None:
    at = 0.0
    script: list[Request] = []
    for i, (gap, input_len, prefill, decode, handoff) in enumerate(draws):
        at += gap * 0.0137
        decode_s = decode * 0.0529 + i * 1e-7
        script.append((at, input_len, prefill * 0.0311 + i * 1e-6, decode_s, min(handoff * 0.0173 + i * 1e-9,
                                                                                  decode_s / 2)))
    _check(tiny_model, script, name, "handoff")
