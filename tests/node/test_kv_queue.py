"""ThunderServe's KV queues on the runtime (the phase-split schedulers' decode_booking "handoff"), in process.

Real HopServers with real engines (a tiny random-weight model) on the memory transport, the coordinator's real
PipelineGenerator, and a real Deployment serving a phase-split plan through a SplitScheduler that books the decode
KV at the hand-off. The prefill hop keeps each prompt's KV in its paged cache after the prefill (the first token
streams at once); the decode hops reserve only when the scheduler lets the hand-off start, and wait for room
rather than refuse; the prefill hop sends on the coordinator's SendKV and frees the KV. Greedy output equals the
single process's with more requests than the decode side's KV holds at once, whether the scheduler's estimate or
the decode node's real pool is what binds; every block is free at the end, also when the client goes away or
the node holding the KV goes down while the hand-off waits.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import trio
import trio.testing
from raw_peer import RawPeer
from test_handoff import PROFILE, _nodes, collect, split_route

from hetnode.coordinator.deployment import Deployment, Plan, Shard
from hetnode.coordinator.generation import GenerationParams
from hetnode.coordinator.local import LocalGenerator
from hetnode.coordinator.registry import Registry
from hetnode.coordinator.sessions import PipelineGenerator
from hetnode.coordinator.split_scheduler import SplitScheduler
from hetnode.ids import NodeId
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.models.tokenizer import load_tokenizer
from hetnode.node.engine import EngineConfig, SamplingParams
from hetnode.node.hops import HopServer
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.policy.decode_booking import HANDOFF
from hetnode.protocol.framing import FramedStream
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.messages import (
    KV,
    KV_PROTOCOL,
    Assignment,
    AssignmentStatus,
    ErrorReply,
    Failed,
    HandedOver,
    Install,
    Item,
    Items,
    Join,
    Ready,
    Reserve,
    Sampling,
    SendKV,
    TensorMeta,
    Tokens,
)
from hetnode.protocol.routes import pipeline_route
from hetnode.protocol.tensors import to_wire

# Prompts of 70, 25, 41, 3, 58 and 33 tokens: KV of up to 82 positions (21 blocks of 4) each with the output.
PROMPTS = [list(range(100, 170)), list(range(20, 45)), list(range(200, 241)), [5, 6, 7], list(range(230, 288)),
           list(range(40, 73))]
MAX_TOKENS = 12
BLOCK = 4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama")


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with LocalGenerator.open(tiny_model) as local:
            return [await collect(local, p, MAX_TOKENS) for p in PROMPTS]

    return trio.run(run)


@dataclass
class Net:
    gen: PipelineGenerator
    deployment: Deployment
    scheduler: SplitScheduler
    nodes: dict[str, HopServer]
    scopes: dict[str, trio.CancelScope]
    layers: int


def placement(prefill: list[str], decode: list[str], layers: int) -> PlacementPlan:
    return PlacementPlan(cluster="kv-queue", model="tiny", num_layers=layers, method="split",
                         placements=tuple(NodePlacement(n, 0, layers) for n in prefill + decode),
                         replicas=tuple([Replica("prefill", (n,)) for n in prefill]
                                        + [Replica("decode", (n,)) for n in decode]))


@asynccontextmanager
async def network(model: Path, prefill: list[str], decode: list[str], *, kv_blocks: dict[str, int],
                  kv_capacity: dict[str, int] | None = None, max_reroutes: int = 0) -> AsyncIterator[Net]:
    """Nodes holding every layer each, a coordinator whose deployment serves `prefill` and `decode` replicas with
    the scheduler's decode KV booked at the hand-off; `kv_capacity`: the scheduler's view of the nodes' KV in
    tokens (missing: not limited), `kv_blocks`: their real pools."""
    cfg = load_config(model)
    layers = cfg.num_layers
    net = MemoryNetwork()
    registry = Registry(token="t", heartbeat_deadline_s=60.0)
    plan_of = placement(prefill, decode, layers)
    scheduler = SplitScheduler(plan_of, kv_capacity=kv_capacity, high_water=1.0, avg_output_len=MAX_TOKENS,
                               learn_output=False, decode_booking=HANDOFF)

    async def no_control(*args: Any) -> None:
        raise AssertionError("the deployment does not run here")

    async with trio.open_nursery() as nursery, net.transport("coord") as ct:
        deployment = Deployment(registry, no_control, model=str(model), model_config=cfg,  # type: ignore[arg-type]
                                coordinator=NodeId("coord"))
        gen = PipelineGenerator(ct, registry, deployment, model_name=str(model), model_config=cfg,
                                tokenizer=load_tokenizer(model), step_timeout_s=60.0, max_reroutes=max_reroutes)
        await nursery.start(gen.run)
        scopes: dict[str, trio.CancelScope] = {}

        async def run_node(name: str, *, task_status: trio.TaskStatus[HopServer]) -> None:
            with trio.CancelScope() as scope:
                scopes[name] = scope
                async with net.transport(name) as t, trio.open_nursery() as inner:
                    hops = HopServer(t, lambda peer: True,
                                     engine_config=EngineConfig(num_kv_blocks=kv_blocks.get(name, 256),
                                                                block_size=BLOCK))
                    hops.is_coordinator = lambda peer: peer == "coord"
                    await inner.start(hops.run)

                    async def report(status: AssignmentStatus) -> None:
                        assert status.state != "failed", status.detail

                    await hops.assign(Assignment(plan_version=1, model=str(model), first_layer=0, last_layer=layers,
                                                 role="mixed"), report)
                    task_status.started(hops)
                    await trio.sleep_forever()

        nodes = {name: await nursery.start(run_node, name) for name in prefill + decode}
        for name in nodes:
            assert registry.admit(NodeId(name), Join(token="t", name=name, profile=PROFILE, listen_addrs=[]),
                                  now=trio.current_time(), wall=time.time()).admitted
        shards = [Shard(p.node, p.first_layer, p.last_layer) for p in plan_of.placements]
        plan = Plan(1, shards, [s.peer for s in shards], "test", 0.0, plan_of, scheduler)
        plan.ready = {NodeId(s.peer) for s in shards}
        deployment.plan = deployment.serving = plan
        yield Net(gen, deployment, scheduler, nodes, scopes, layers)
        nursery.cancel_scope.cancel()


async def all_free(net: Net, *names: str) -> None:
    """Every session released on the nodes and every block back in their pools (waits for the releases)."""
    await net.gen.wait_released()
    await trio.testing.wait_all_tasks_blocked()
    for name in names or tuple(net.nodes):
        hops = net.nodes[name]
        assert not hops.sessions, name
        assert hops.loop is not None
        await hops.loop.wait_idle()
        assert hops.loop.ledger.used == 0 and hops.loop.waiting_reservations == 0, name
        assert hops.loop.engine.kv_usage().used_blocks == 0, name


async def run_all(net: Net, prompts: list[list[int]], n: int = MAX_TOKENS) -> dict[int, list[int]]:
    got: dict[int, list[int]] = {}

    async def one(i: int) -> None:
        got[i] = await collect(net.gen, prompts[i], n)

    async with trio.open_nursery() as nursery:
        for i in range(len(prompts)):
            nursery.start_soon(one, i)
    return got


async def test_the_schedulers_decode_room_binds_hand_offs_wait_on_the_prefill_side_and_output_is_exact(
        tiny_model: Path, reference: list[list[int]]) -> None:
    # The scheduler sees room for about one request's decode KV (70 + 12 tokens) on d; p holds every prompt.
    async with network(tiny_model, ["p"], ["d"], kv_blocks={}, kv_capacity={"p": 2000, "d": 90}) as net:
        kept: list[int] = []  # sessions the prefill hop held after their first token, sampled at each token

        def watch(*_: Any) -> None:
            kept.append(sum(1 for s in net.nodes["p"].sessions.values() if s.computed >= (s.span_end or 0)))

        net.deployment.on_handoff = _chain(net.deployment.on_handoff, watch)
        got = await run_all(net, PROMPTS)
        assert [got[i] for i in range(len(PROMPTS))] == reference
        # Every request was admitted at once (the prefill side binds admission), and most hand-offs waited for
        # the decode replica's room with their KV on p.
        assert net.gen.kv_queue["waited"] >= 3 and sum(net.gen.kv_queue.values()) == len(PROMPTS)
        assert max(kept) >= 2
        assert net.gen.reroutes == 0 and net.scheduler.waiting_handoffs() == 0 and net.scheduler.running == 0
        p, d = net.nodes["p"], net.nodes["d"]
        assert p.kv_bytes_sent > 0 and p.kv_bytes_received == 0 and d.kv_bytes_received == p.kv_bytes_sent
        await all_free(net)


async def test_the_decode_nodes_real_pool_binds_reservations_wait_there_and_never_fail(
        tiny_model: Path, reference: list[list[int]]) -> None:
    # The scheduler's estimate is unlimited (as before the nodes' first heartbeats report their real pools), so
    # every hand-off starts at its first token; d's real pool holds 24 blocks: the 70-token prompt, or a few
    # short ones, at a time. Two tokens each: the decode side's KV barely grows, so nothing is preempted and
    # what binds is the reservations, which wait at d for releases, in order.
    async with network(tiny_model, ["p"], ["d"], kv_blocks={"d": 24}) as net:
        waited: list[int] = []
        d = net.nodes["d"]
        assert d.loop is not None
        loop = d.loop
        grant = loop._grant

        def counting() -> None:
            waited.append(loop.waiting_reservations)
            grant()

        loop._grant = counting  # type: ignore[method-assign]
        got = await run_all(net, PROMPTS, 2)
        assert [got[i] for i in range(len(PROMPTS))] == [r[:2] for r in reference]
        assert max(waited) >= 1  # some reservation found no room and waited
        assert net.gen.reroutes == 0
        await all_free(net)


async def test_a_client_that_leaves_while_its_hand_off_waits_frees_the_kept_kv(
        tiny_model: Path, reference: list[list[int]]) -> None:
    # d's room (by the scheduler) is one request's: a first client holds it (it reads its first token, then waits:
    # its request runs until the client is done), so the second one's hand-off waits with its KV on p.
    async with network(tiny_model, ["p"], ["d"], kv_blocks={}, kv_capacity={"p": 2000, "d": 90}) as net:
        holding, done, waiting = trio.Event(), trio.Event(), trio.Event()
        got: list[int] = []
        params = GenerationParams(max_tokens=MAX_TOKENS, sampling=SamplingParams())

        async def blocker() -> None:
            async with net.gen.generate(PROMPTS[0], params) as events, aclosing(events.__aiter__()) as it:
                async for event in it:
                    got.append(event.token)
                    holding.set()
                    await done.wait()

        async def leaver() -> None:
            async with net.gen.generate(PROMPTS[4], params) as events, aclosing(events.__aiter__()) as it:
                async for _ in it:
                    waiting.set()
                    await trio.sleep_forever()  # a client that stops reading; cancelled below

        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(blocker)
                await holding.wait()
                async with trio.open_nursery() as inner:
                    inner.start_soon(leaver)
                    await waiting.wait()
                    # Its first token came; d is the first request's, so its KV waits on p, handed nowhere.
                    assert net.scheduler.waiting_handoffs() == 1
                    (kept,) = [s for s in net.nodes["p"].sessions.values() if s.prefill_end == len(PROMPTS[4])]
                    assert kept.kv_queued and not kept.kv_booked and net.nodes["p"].loop.ledger.held(kept.id) > 0
                    assert kept.id in net.nodes["d"].sessions and kept.id not in net.nodes["d"].loop.ledger
                    inner.cancel_scope.cancel()  # the client goes
                await net.gen.wait_released()
                await trio.testing.wait_all_tasks_blocked()
                # Its KV is freed on p, and d never reserved any; the first request runs on.
                assert kept.id not in net.nodes["p"].sessions and kept.id not in net.nodes["p"].loop.ledger
                assert kept.id not in net.nodes["d"].sessions and net.scheduler.waiting_handoffs() == 0
                done.set()
        assert got == reference[0]
        assert net.scheduler.running == 0
        await all_free(net)
        assert await collect(net.gen, PROMPTS[1], MAX_TOKENS) == reference[1]  # serving goes on
        await all_free(net)


@pytest.mark.parametrize("how", ["died", "left with its drain run out"])
async def test_a_prefill_node_that_goes_down_holding_queued_kv_moves_the_request(
        tiny_model: Path, reference: list[list[int]], how: str, caplog: pytest.LogCaptureFixture) -> None:
    """A node that died takes every session it is part of; one that left gracefully only those of its last phase,
    and those whose KV it still kept for a hand-off that had not started (the lifecycle's `holding`): the request
    moves at once, for that reason, not later when the hand-off finds the node gone."""
    async with network(tiny_model, ["p0", "p1"], ["d"], kv_blocks={}, kv_capacity={"p0": 2000, "p1": 2000,
                                                                                   "d": 90}, max_reroutes=1) as net:
        got: dict[int, list[int]] = {}
        holding = trio.Event()

        def watch(*_: Any) -> None:
            if net.scheduler.waiting_handoffs() and not holding.is_set():
                holding.set()

        async def one(i: int) -> None:
            got[i] = await collect(net.gen, PROMPTS[i], MAX_TOKENS)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one, 0)
            nursery.start_soon(one, 4)
            # Wait for the second's first token: it then waits for d with its KV on its prefill node.
            while not holding.is_set():
                await net.gen._progress.wait()
                watch()
            (waiting,) = [s for s in net.gen._sessions.values() if s.prefilled and not s.booked]
            (name,) = [n for n, hops in net.nodes.items() if waiting.id in hops.sessions and n.startswith("p")]
            assert net.nodes[name].sessions[waiting.id].kv_queued
            net.scopes[name].cancel()  # the node holding the kept KV goes
            net.deployment.node_down(NodeId(name))
            net.gen.node_down(NodeId(name), "lost" if how == "died" else "left")
        assert got == {0: reference[0], 4: reference[4]}
        assert net.gen.reroutes == 1  # the request whose KV was lost re-prefilled on the other prefill node
        (moved,) = [r.getMessage() for r in caplog.records if " moved to " in r.getMessage()]
        assert moved.endswith(f"node {name} went down ({'lost' if how == 'died' else 'left'})"), moved
        await all_free(net, *(n for n in net.nodes if n != name))


def _chain(*fns: Any) -> Any:
    def both(*args: Any) -> None:
        for fn in fns:
            if fn is not None:
                fn(*args)

    return both


async def test_reserve_and_send_kv_only_from_the_sessions_coordinator_and_only_in_turn(tiny_model: Path) -> None:
    """Against a raw coordinator and a raw stranger: Reserve and SendKV from anyone but the installing coordinator
    are refused; from it, a Reserve for a session handed no queued KV, a SendKV before the prefill is done or a
    second one are refused; a KV frame before the Reserve is refused and resets its stream; none of it touches
    the session's KV. An Install that queues KV on a route that cannot is refused. In turn, the prefill hop keeps
    its KV after the first token until SendKV, the decode hop reserves on Reserve, and the output is the same."""
    layers = load_config(tiny_model).num_layers
    net = MemoryNetwork()
    prompt = PROMPTS[1]
    async with trio.open_nursery() as nursery, net.transport("coord") as ct, net.transport("evil") as et:
        servers: dict[str, HopServer] = {}
        async with _nodes(net, nursery, tiny_model, [("p", (0, layers)), ("d", (0, layers))], servers, {}):
            p, d = servers["p"], servers["d"]
            coord, evil = RawPeer(ct), RawPeer(et)
            route = split_route([("p", 0, layers)], [("d", 0, layers)])
            install = Install(session="s", route=route, sampling=Sampling(), prefill_end=len(prompt), max_tokens=4,
                              lease_s=30, kv_queued=True)
            meta, raw = to_wire(torch.tensor(prompt))
            with trio.fail_after(60):
                # A route that cannot queue its KV: refused.
                await coord.send("p", Install(session="m", route=pipeline_route(route.phases[0].hops),
                                              sampling=Sampling(), prefill_end=3, max_tokens=4, lease_s=30,
                                              kv_queued=True))
                _, failed = await coord.next_of(Failed)
                assert failed.session == "m" and "keeps its KV queued" in failed.reason and "m" not in p.sessions
                for peer in ("p", "d"):
                    await coord.send(peer, install)
                await coord.send("p", SendKV(session="s"))  # before the prefill: refused
                assert "computed [0, 0)" in (await coord.next_of(ErrorReply))[1].message
                await coord.send("p", Items(items=[Item("s", 0, len(prompt))], tensor=meta), raw)
                _, tokens = await coord.next_of(Tokens)
                assert tokens.tokens[0].position == len(prompt)  # the first token, at once
                await trio.testing.wait_all_tasks_blocked()
                # p keeps the KV; d holds the first token and has reserved nothing.
                assert p.sessions["s"].kv_queued and p.kv_bytes_sent == 0 and p.loop is not None
                assert p.loop.ledger.held("s") > 0
                assert d.loop is not None and "s" not in d.loop.ledger and not d.sessions["s"].kv_reserved
                # Strangers and out-of-turn words change nothing.
                for peer in ("p", "d"):
                    for msg in (Reserve(session="s"), SendKV(session="s")):
                        await evil.send(peer, msg)
                        assert (await evil.next_of(ErrorReply))[1].code == "not_yours"
                await coord.send("p", Reserve(session="s"))  # p is handed nothing
                assert (await coord.next_of(ErrorReply))[1].code == "unexpected"
                await coord.send("d", SendKV(session="s"))  # d keeps nothing
                assert (await coord.next_of(ErrorReply))[1].code == "unexpected"
                # A KV frame before the Reserve: an error and a reset stream, nothing written.
                kv_stream = await _kv_stream(et, "d")
                await kv_stream.send_with_payload(KV(session="s", first_layer=0, layers=1, start=0, count=1,
                                                     codec="fp32", tensor=TensorMeta("uint8", [8])), b"\0" * 8)
                reply = await kv_stream.receive_msg(_error_decoder)
                assert isinstance(reply, ErrorReply)
                assert "s" not in d.loop.ledger and d.kv_bytes_received == 0
                assert p.kv_bytes_sent == 0 and p.loop.ledger.held("s") > 0
                # In turn: Reserve, Ready, SendKV, HandedOver, and the rest of the tokens.
                await coord.send("d", Reserve(session="s"))
                assert (await coord.next_of(Ready))[0] == "d"
                await coord.send("d", Reserve(session="s"))  # once only
                assert (await coord.next_of(ErrorReply))[1].code == "unexpected"
                await coord.send("p", SendKV(session="s"))
                assert (await coord.next_of(HandedOver))[0] == "p"
                await coord.send("p", SendKV(session="s"))  # p has freed it: not there any more
                assert (await coord.next_of(ErrorReply))[1].code == "not_yours"
                got = [tokens.tokens[0].token]
                while len(got) < 4:
                    _, more = await coord.next_of(Tokens)
                    got += [t.token for t in more.tokens]
                assert "s" not in p.sessions and p.loop.ledger.used == 0
        nursery.cancel_scope.cancel()
    async with LocalGenerator.open(tiny_model) as local:
        assert got == await collect(local, prompt, 4)


async def _kv_stream(transport: Any, peer: str) -> FramedStream:
    return FramedStream(await transport.open_stream(NodeId(peer), KV_PROTOCOL))


_error_decoder = msgspec.msgpack.Decoder(ErrorReply)
