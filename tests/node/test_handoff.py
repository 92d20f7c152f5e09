"""Phase-split serving in process: a prefill pipeline hands each layer's KV to the decode pipeline that holds it.

Real HopServers with real engines (a tiny random-weight model, three nodes) on the memory transport, and the
coordinator's real PipelineGenerator with routes given by the test. Greedy output equals the single process's,
whatever the two phases' layer cuts and whether the KV goes whole after each step or layer by layer from inside
it; the first token comes from the prefill side; the prefill side frees its KV once it is handed over; a decode
side that cannot reserve the KV refuses before any prefill.
"""

from __future__ import annotations

import math
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from hetnode.coordinator.deployment import Deployment
from hetnode.coordinator.generation import GenerationError, GenerationParams
from hetnode.coordinator.local import LocalGenerator
from hetnode.coordinator.registry import Registry
from hetnode.coordinator.sessions import PipelineGenerator
from hetnode.ids import NodeId
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.models.tokenizer import load_tokenizer
from hetnode.node.engine import EngineConfig, SamplingParams
from hetnode.node.hops import HopServer
from hetnode.policy import KVTransferPolicy
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.messages import (
    Assignment,
    AssignmentStatus,
    HardwareProfile,
    Hop,
    Join,
    KVLink,
    Phase,
    Route,
)
from hetnode.protocol.routes import pipeline_route

PROMPTS = [[5, 6, 7], list(range(20, 45)), list(range(100, 170))]
MAX_TOKENS = 12
WHOLE = KVTransferPolicy(min_layerwise_s=math.inf)
LAYERWISE = KVTransferPolicy(min_layerwise_s=0, min_group_bytes=0, max_groups=1024)  # a frame per layer
HALVES = KVTransferPolicy(min_layerwise_s=0, min_group_bytes=0, max_groups=2)  # 3 layers: groups of 2, 1
TRANSFERS = {"whole": WHOLE, "layerwise": LAYERWISE, "halves": HALVES}
PROFILE = HardwareProfile(device="cpu", device_type="cpu", memory_bytes=8 << 30, matmul_tflops=0.1,
                          mem_bandwidth_gbps=10.0, dtype="float32")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp(request.param) / "m", request.param)


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with LocalGenerator.open(tiny_model) as local:
            return [await collect(local, p) for p in PROMPTS]

    return trio.run(run)


async def collect(gen: Any, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    params = GenerationParams(max_tokens=n, sampling=SamplingParams())
    async with gen.generate(prompt, params) as events:
        return [e.token async for e in events]


@dataclass
class Net:
    gen: PipelineGenerator
    nodes: dict[str, HopServer]
    layers: int


@asynccontextmanager
async def network(model: Path, shards: dict[str, tuple[int, int]], kv_blocks: dict[str, int] | None = None,
                  kv_transfer: KVTransferPolicy | None = None) -> AsyncIterator[Net]:
    cfg = load_config(model)
    net = MemoryNetwork()
    registry = Registry(token="t", heartbeat_deadline_s=60.0)
    async with trio.open_nursery() as nursery, net.transport("coord") as ct:
        for name in shards:
            admission = registry.admit(NodeId(name), Join(token="t", name=name, profile=PROFILE, listen_addrs=[]),
                                       now=trio.current_time(), wall=time.time())
            assert admission.admitted

        async def no_control(*args: Any) -> None:
            raise AssertionError("the deployment does not run here")

        deployment = Deployment(registry, no_control, model=str(model), model_config=cfg,  # type: ignore[arg-type]
                                coordinator=NodeId("coord"))
        gen = PipelineGenerator(ct, registry, deployment, model_name=str(model), model_config=cfg,
                                tokenizer=load_tokenizer(model), step_timeout_s=30.0, max_reroutes=0)
        await nursery.start(gen.run)
        servers: dict[str, HopServer] = {}
        async with _nodes(net, nursery, model, list(shards.items()), servers, kv_blocks or {}, kv_transfer):
            yield Net(gen, servers, cfg.num_layers)
        nursery.cancel_scope.cancel()


@asynccontextmanager
async def _nodes(net: MemoryNetwork, nursery: trio.Nursery, model: Path, shards: list[tuple[str, tuple[int, int]]],
                 out: dict[str, HopServer], kv_blocks: dict[str, int],
                 kv_transfer: KVTransferPolicy | None = None) -> AsyncIterator[None]:
    if not shards:
        yield
        return
    (name, (a, b)), rest = shards[0], shards[1:]
    async with net.transport(name) as t:
        config = EngineConfig(num_kv_blocks=kv_blocks.get(name, 256), block_size=4)
        hops = HopServer(t, lambda peer: True, engine_config=config, kv_transfer=kv_transfer)
        hops.is_coordinator = lambda peer: peer == "coord"
        await nursery.start(hops.run)

        async def report(status: AssignmentStatus) -> None:
            assert status.state != "failed", status.detail

        await hops.assign(Assignment(plan_version=1, model=str(model), first_layer=a, last_layer=b, role="mixed"),
                          report)
        out[name] = hops
        async with _nodes(net, nursery, model, rest, out, kv_blocks, kv_transfer):
            yield


def split_route(prefill: list[tuple[str, int, int]], decode: list[tuple[str, int, int]],
                codecs: dict[tuple[str, str], str] | None = None) -> Route:
    links = [KVLink(src=s, dst=d, codec=c) for (s, d), c in (codecs or {}).items()]  # type: ignore[arg-type]
    return Route(phases=[
        Phase(kind="prefill", hops=[Hop(peer=n, first_layer=a, last_layer=b) for n, a, b in prefill],
              kv_links=links),
        Phase(kind="decode", hops=[Hop(peer=n, first_layer=a, last_layer=b) for n, a, b in decode]),
    ])


@pytest.mark.parametrize("transfer", list(TRANSFERS))
@pytest.mark.parametrize("direction", ["two prefill hops, one decode hop", "one prefill hop, two decode hops"])
async def test_phase_split_greedy_output_equals_the_single_process(tiny_model: Path, reference: list[list[int]],
                                                                   direction: str, transfer: str) -> None:
    layers = load_config(tiny_model).num_layers
    cut = layers // 2
    async with network(tiny_model, {"p0": (0, cut), "p1": (cut, layers), "d": (0, layers)},
                       kv_transfer=TRANSFERS[transfer]) as net:
        if direction.startswith("two prefill"):
            route = split_route([("p0", 0, cut), ("p1", cut, layers)], [("d", 0, layers)])
        else:
            route = split_route([("d", 0, layers)], [("p0", 0, cut), ("p1", cut, layers)])

        async def fixed(exclude: set[NodeId]) -> Route:
            return route

        net.gen.route_for = fixed
        got: dict[int, list[int]] = {}

        async def one(i: int) -> None:
            got[i] = await collect(net.gen, PROMPTS[i])

        async with trio.open_nursery() as nursery:
            for i in range(len(PROMPTS)):
                nursery.start_soon(one, i)
        assert [got[i] for i in range(len(PROMPTS))] == reference
        # The prefill side handed its KV over and kept none; the decode side's is released with the request.
        await trio.testing.wait_all_tasks_blocked()
        senders = ["p0", "p1"] if direction.startswith("two prefill") else ["d"]
        for name, hops in net.nodes.items():
            assert not hops.sessions, name
            if name in senders:
                assert hops.kv_bytes_sent > 0 and hops.kv_bytes_received == 0
            else:
                assert hops.kv_bytes_received > 0 and hops.kv_bytes_sent == 0
        # Each prompt is one prefill step: one frame per target whole, one per layer group layer-wise.
        frames = {name: net.nodes[name].kv_frames_sent for name in senders}
        groups = [TRANSFERS[transfer].choose(1, n, 1.0).groups for n in (cut, layers - cut)]
        want = {"p0": groups[0], "p1": groups[1]} if direction.startswith("two prefill") else {"d": sum(groups)}
        assert frames == {name: n * len(PROMPTS) for name, n in want.items()}
        assert sum(frames.values()) == len(PROMPTS) * {"whole": 2, "layerwise": layers, "halves": 4}[transfer]


async def test_a_decode_hop_without_room_for_the_kv_refuses_before_any_prefill(tiny_model: Path) -> None:
    layers = load_config(tiny_model).num_layers
    async with network(tiny_model, {"p": (0, layers), "d": (0, layers)}, kv_blocks={"d": 2}) as net:
        route = split_route([("p", 0, layers)], [("d", 0, layers)])

        async def fixed(exclude: set[NodeId]) -> Route:
            return route

        net.gen.route_for = fixed
        with pytest.raises(GenerationError, match="no KV memory free"):
            await collect(net.gen, PROMPTS[2])  # 70 tokens: 18 blocks of 4, d has 2
        assert net.nodes["p"].loop is not None and net.nodes["p"].loop.steps == 0  # nothing was prefilled
        assert await collect(net.gen, PROMPTS[0], 4)  # 3 tokens fit in d's 2 blocks ... with room to grow


@pytest.mark.parametrize("transfer", ["whole", "layerwise"])
async def test_a_partial_prefill_hands_its_kv_to_the_phase_that_finishes_the_prompt(
        tiny_model: Path, reference: list[list[int]], transfer: str) -> None:
    """Cronus: the weak node prefills tokens [0, k), the strong one the rest of the prompt beside its decodes. A
    prompt shorter than k is prefilled whole on the weak node, which then samples the first token."""
    layers = load_config(tiny_model).num_layers
    k = 20
    async with network(tiny_model, {"weak": (0, layers), "strong": (0, layers)},
                       kv_transfer=TRANSFERS[transfer]) as net:
        route = Route(phases=[
            Phase(kind="prefill", hops=[Hop(peer="weak", first_layer=0, last_layer=layers)], last_token=k),
            Phase(kind="mixed", hops=[Hop(peer="strong", first_layer=0, last_layer=layers)], first_token=k),
        ])

        async def fixed(exclude: set[NodeId]) -> Route:
            return route

        net.gen.route_for = fixed
        assert [await collect(net.gen, p) for p in PROMPTS] == reference
        weak, strong = net.nodes["weak"], net.nodes["strong"]
        assert weak.loop is not None and strong.loop is not None
        # The weak node ran 3 + 20 + 20 prompt tokens and one sampling step; the strong one the rest.
        assert weak.kv_bytes_sent > 0 and strong.kv_bytes_received == weak.kv_bytes_sent


async def test_kv_frames_out_of_place_get_an_error_and_a_reset_and_touch_no_session(tiny_model: Path) -> None:
    """A hand-off target against raw peers: KV for an unknown session, from a hop the route does not name, of
    the wrong size or codec, or out of order is refused with a reset stream; the session's KV is untouched and a
    correct hand-off still completes it. KV for a released session gets an error reply only."""
    import torch
    from raw_peer import RawPeer

    from hetnode.kv.codecs import CODECS
    from hetnode.protocol.framing import FramedStream
    from hetnode.protocol.messages import KV, KV_PROTOCOL, ErrorReply, Install, Ready, Release, Sampling, TensorMeta
    from hetnode.protocol.messages import kv_decoder as decoder

    cfg = load_config(tiny_model)
    layers = cfg.num_layers
    net = MemoryNetwork()
    async with trio.open_nursery() as nursery, net.transport("coord") as ct, net.transport("p") as pt, \
            net.transport("evil") as et:
        servers: dict[str, HopServer] = {}
        async with _nodes(net, nursery, tiny_model, [("d", (0, layers))], servers, {}):
            d = servers["d"]
            coord = RawPeer(ct)
            route = split_route([("p", 0, layers)], [("d", 0, layers)])
            with trio.fail_after(10):
                await coord.send("d", Install(session="s", route=route, sampling=Sampling(), prefill_end=8,
                                              max_tokens=4, lease_s=30))
                await coord.next_of(Ready)
            keys = torch.randn(layers, 8, cfg.num_kv_heads, cfg.head_dim)
            values = torch.randn(layers, 8, cfg.num_kv_heads, cfg.head_dim)

            def frame(session: str = "s", start: int = 0, count: int = 8, codec: str = "fp16",
                      cut: int = 0) -> tuple[KV, bytes]:
                data = bytes(CODECS[codec].pack(keys[:, start:start + count], values[:, start:start + count]))
                data = data[:len(data) - cut]
                return KV(session=session, first_layer=0, layers=layers, start=start, count=count,
                          codec=codec, tensor=TensorMeta("uint8", [len(data)])), data  # type: ignore[arg-type]

            async def attempt(transport: Any, msg: KV, data: bytes) -> str:
                framed = FramedStream(await transport.open_stream(NodeId("d"), KV_PROTOCOL))
                await framed.send_with_payload(msg, data)
                with trio.fail_after(10):
                    reply = await framed.receive_msg(decoder)
                assert isinstance(reply, ErrorReply)
                return reply.code

            assert d.loop is not None
            # (Freed blocks are not zeroed: what the reserved ones hold now must be what they hold after.)
            before = await d.loop.run_engine(lambda e: e.export_kv("s", 0, 8))  # type: ignore[arg-type]
            assert await attempt(pt, *frame(session="nobody")) == "bad_message"
            assert await attempt(et, *frame()) == "bad_message"  # not the hop that computed those layers
            assert await attempt(pt, *frame(cut=1)) == "bad_message"  # one byte short
            assert await attempt(pt, *frame(start=4, count=4)) == "bad_message"  # must start at 0
            session = d.sessions["s"]
            assert session.kv_waiting and set(session.kv_next.values()) == {0}
            held = await d.loop.run_engine(lambda e: e.export_kv("s", 0, 8))  # type: ignore[arg-type]
            assert torch.equal(held[0], before[0]) and torch.equal(held[1], before[1])  # nothing was written
            # The real hand-off, in two parts and another codec.
            framed = FramedStream(await pt.open_stream(NodeId("d"), KV_PROTOCOL))
            await framed.send_with_payload(*frame(count=5))
            await framed.send_with_payload(*frame(start=5, count=3, codec="int8"))
            with trio.fail_after(10):
                await session.kv_done.wait()
            got = await d.loop.run_engine(lambda e: e.export_kv("s", 0, 8))  # type: ignore[arg-type]
            assert torch.allclose(got[0][:, :5], keys[:, :5], atol=1e-2)
            await coord.send("d", Release(session="s"))
            await trio.testing.wait_all_tasks_blocked()
            replies, inbox = trio.open_memory_channel[Any](8)

            async def kv_replies(stream: Any) -> None:  # the node answers on its own stream to us
                reader = FramedStream(stream)
                while (msg := await reader.receive_msg(decoder)) is not None:
                    await replies.send(msg)

            pt.set_handler(KV_PROTOCOL, kv_replies)
            framed = FramedStream(await pt.open_stream(NodeId("d"), KV_PROTOCOL))
            await framed.send_with_payload(*frame(count=5))
            with trio.fail_after(10):
                reply = await inbox.receive()
            assert isinstance(reply, ErrorReply) and reply.code == "released"
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("mbps, operator, want", [(1.0, "auto", "int4"), (100_000.0, "auto", "fp16"),
                                                  (1.0, "int8", "int8"), (None, "auto", "fp16")])
async def test_each_hand_off_link_gets_the_cheapest_codec_for_its_measured_bandwidth(
        tiny_model: Path, mbps: float | None, operator: str, want: str) -> None:
    """From the link's measured bandwidth and the nodes' measured codec rates (heartbeats): a slow link sends
    int4, a fast one fp16, the operator's codec is obeyed, and an unmeasured link sends fp16."""
    import msgspec

    from hetnode.coordinator.registry import LinkEntry
    from hetnode.policy.kv_codec import KVCodecPolicy
    from hetnode.protocol.kv_wire import packed_size
    from hetnode.protocol.messages import CodecRate

    # The nodes measure their rates when a shard loads; a loaded machine moves them by more than the margins
    # between codecs on a tiny model's KV, so the choice is made here from fixed rates of the same magnitudes.
    rates = [CodecRate("fp16", 8e9, 8e9), CodecRate("int8", 2e9, 3e9), CodecRate("int4", 1.3e9, 2e9)]
    layers = load_config(tiny_model).num_layers
    async with network(tiny_model, {"p": (0, layers), "d": (0, layers)}) as net:
        for name, hops in net.nodes.items():
            assert {r.codec for r in hops.load().kv_codec_rates} >= {"fp16", "int8", "int4"}
            # (And no re-prefill on the decode side: its prefill rate, measured at load, would beat 1 Mbit/s.)
            load = msgspec.structs.replace(hops.load(), kv_codec_rates=rates, prefill_tokens_per_s=0.0)
            assert net.gen.registry.heartbeat(NodeId(name), load, now=trio.current_time(), wall=time.time())
        if mbps is not None:
            net.gen.registry.links[(NodeId("p"), NodeId("d"))] = LinkEntry(mbps, 1.0, time.time())
        net.gen.kv_codecs = KVCodecPolicy(operator)
        route = net.gen.with_codecs(split_route([("p", 0, layers)], [("d", 0, layers)]), 512)
        assert [(k.src, k.dst, k.codec) for k in route.phases[0].kv_links] == [("p", "d", want)]

        async def fixed(exclude: set[NodeId]) -> Route:
            return split_route([("p", 0, layers)], [("d", 0, layers)])

        net.gen.route_for = fixed
        assert len(await collect(net.gen, PROMPTS[2], 4)) == 4  # the request runs with that codec
        cfg = load_config(tiny_model)
        sent = packed_size(want, layers, len(PROMPTS[2]), cfg.num_kv_heads, cfg.head_dim)  # one prefill step
        assert net.nodes["d"].kv_bytes_received == net.nodes["p"].kv_bytes_sent == sent


@pytest.mark.parametrize("measured", [True, False])
async def test_auto_re_prefills_on_the_decode_side_when_that_beats_every_codec(
        tiny_model: Path, reference: list[list[int]], measured: bool) -> None:
    """A slow link and a decode node whose measured prefill rate recomputes the context sooner than any codec
    moves its KV: the request runs as one mixed phase on the decode node, no KV moves, the output is the same.
    Until the decode node has measured a prefill rate, the KV is handed over."""
    import msgspec

    from hetnode.coordinator.registry import LinkEntry

    layers = load_config(tiny_model).num_layers
    async with network(tiny_model, {"p": (0, layers), "d": (0, layers)}) as net:
        for name, hops in net.nodes.items():
            load = hops.load()
            if name == "d":
                load = msgspec.structs.replace(load, prefill_tokens_per_s=1e6 if measured else 0.0)
            assert net.gen.registry.heartbeat(NodeId(name), load, now=trio.current_time(), wall=time.time())
        net.gen.registry.links[(NodeId("p"), NodeId("d"))] = LinkEntry(0.01, 1.0, time.time())  # 10 kbit/s
        split = split_route([("p", 0, layers)], [("d", 0, layers)])
        route = net.gen.with_codecs(split, len(PROMPTS[1]))
        if not measured:
            assert len(route.phases) == 2 and route.phases[0].kv_links[0].codec == "int4"
            return
        assert route == pipeline_route([Hop(peer="d", first_layer=0, last_layer=layers)])

        async def fixed(exclude: set[NodeId]) -> Route:
            return split

        net.gen.route_for = fixed
        assert await collect(net.gen, PROMPTS[1]) == reference[1]
        assert net.nodes["d"].kv_bytes_received == net.nodes["p"].kv_bytes_sent == 0


async def test_a_decode_hop_that_dies_during_the_hand_off_moves_the_request(
        tiny_model: Path, reference: list[list[int]]) -> None:
    """The decode hop dies while the prefill step runs: sending it the first token and the KV fails, the prefill
    hop (which has freed the session by then) still reports it, and the request moves and completes."""
    layers = load_config(tiny_model).num_layers
    cfg = load_config(tiny_model)
    net = MemoryNetwork()
    registry = Registry(token="t", heartbeat_deadline_s=60.0)
    scopes: dict[str, trio.CancelScope] = {}
    gone: dict[str, trio.Event] = {}
    killed: list[str] = []

    async def no_control(*args: Any) -> None:
        raise AssertionError("the deployment does not run here")

    async with trio.open_nursery() as nursery, net.transport("coord") as ct:
        deployment = Deployment(registry, no_control, model=str(tiny_model), model_config=cfg,  # type: ignore[arg-type]
                                coordinator=NodeId("coord"))
        gen = PipelineGenerator(ct, registry, deployment, model_name=str(tiny_model), model_config=cfg,
                                tokenizer=load_tokenizer(tiny_model), step_timeout_s=300.0, max_reroutes=1)
        await nursery.start(gen.run)

        armed = False  # (not during the shard's prefill probe at load)

        def pace(items: Any) -> float:
            if armed and not killed:  # the first prefill step: the decode hop dies while it runs
                killed.append("d1")
                scopes["d1"].cancel()
            return 0.0

        async def run_node(name: str, *, task_status: trio.TaskStatus[HopServer]) -> None:
            gone[name] = trio.Event()
            try:
                with trio.CancelScope() as scope:
                    scopes[name] = scope
                    async with net.transport(name) as t, trio.open_nursery() as inner:
                        hops = HopServer(t, lambda peer: True, engine_config=EngineConfig(num_kv_blocks=256,
                                                                                         block_size=4),
                                         pace_factory=(lambda engine: pace) if name == "p" else None)
                        hops.is_coordinator = lambda peer: peer == "coord"
                        await inner.start(hops.run)

                        async def report(status: AssignmentStatus) -> None:
                            assert status.state != "failed", status.detail

                        await hops.assign(Assignment(plan_version=1, model=str(tiny_model), first_layer=0,
                                                     last_layer=layers, role="mixed"), report)
                        task_status.started(hops)
                        await trio.sleep_forever()
            finally:
                gone[name].set()

        nodes = {name: await nursery.start(run_node, name) for name in ("p", "d1", "d2")}
        for name in nodes:
            assert registry.admit(NodeId(name), Join(token="t", name=name, profile=PROFILE, listen_addrs=[]),
                                  now=trio.current_time(), wall=time.time()).admitted
        routes: list[str] = []
        armed = True

        async def route_for(exclude: set[NodeId]) -> Route:
            decode = "d2" if NodeId("d1") in exclude else "d1"
            routes.append(decode)
            return split_route([("p", 0, layers)], [(decode, 0, layers)])

        gen.route_for = route_for
        with trio.fail_after(60):  # well inside the step timeout: the move follows the failure report
            assert await collect(gen, PROMPTS[1]) == reference[1]
        assert routes == ["d1", "d2"] and killed == ["d1"] and gen.reroutes == 1
        assert nodes["d2"].kv_bytes_received > 0
        nursery.cancel_scope.cancel()


def hops_of(*hops: tuple[str, int, int]) -> list[Hop]:
    return [Hop(peer=n, first_layer=a, last_layer=b) for n, a, b in hops]


@pytest.mark.parametrize("case", ["pipeline to one node", "a hop stays, the other is replaced",
                                  "decode phase of a split route"])
async def test_a_leaving_node_hands_its_sessions_kv_over_and_the_stream_goes_on(
        tiny_model: Path, reference: list[list[int]], case: str) -> None:
    """A hop of the phase that holds a session's KV drains: the coordinator freezes the session there, moves it
    to a route without that hop with the KV handed over layer by layer (a hop that stays keeps its own copy
    locally), and the stream continues token for token as if nothing happened: no re-prefill."""
    layers = load_config(tiny_model).num_layers
    cut = layers // 2
    shards = {"a": (0, cut), "b": (cut, layers), "c": (0, layers), "c2": (cut, layers), "p": (0, layers)}
    before, after, leaver = {
        "pipeline to one node": (pipeline_route(hops_of(("a", 0, cut), ("b", cut, layers))),
                                 pipeline_route(hops_of(("c", 0, layers))), "a"),
        "a hop stays, the other is replaced": (pipeline_route(hops_of(("a", 0, cut), ("b", cut, layers))),
                                               pipeline_route(hops_of(("a", 0, cut), ("c2", cut, layers))), "b"),
        "decode phase of a split route": (split_route([("p", 0, layers)], [("a", 0, cut), ("b", cut, layers)]),
                                          pipeline_route(hops_of(("c", 0, layers))), "b"),
    }[case]
    async with network(tiny_model, shards) as net:
        async def routes(exclude: set[NodeId]) -> Route:
            return after if NodeId(leaver) in exclude else before

        net.gen.route_for = routes
        params = GenerationParams(max_tokens=MAX_TOKENS, sampling=SamplingParams())
        got: list[int] = []
        async with net.gen.generate(PROMPTS[2], params) as events:
            async for event in events:
                got.append(event.token)
                if len(got) == 4:
                    net.gen.node_leaving(NodeId(leaver))
        assert got == reference[2]
        assert (net.gen.migrations, net.gen.reroutes) == (1, 0)
        assert net.gen.recomputed_tokens <= 2  # what followed the KV the hops had when they froze
        receivers = {h.peer for h in after.phases[-1].hops} - {h.peer for h in before.phases[-1].hops}
        assert all(net.nodes[r].kv_bytes_received > 0 for r in receivers)
        await net.gen.wait_released()
        assert not net.nodes[leaver].sessions  # it can go: nothing of the session is left there


async def test_freeze_and_export_only_from_the_sessions_coordinator_and_only_in_order(tiny_model: Path) -> None:
    """Against a raw coordinator and a raw stranger: a stranger's Freeze or Export is refused and changes
    nothing; an Export of a session that is not frozen, or whose route does not put this hop first, fails the
    new session (its coordinator then re-prefills it) and leaves the old one running; a Freeze answers with
    how far the hop computed."""
    import torch
    from raw_peer import RawPeer

    from hetnode.protocol.messages import (
        ErrorReply,
        Export,
        Failed,
        Freeze,
        Frozen,
        Install,
        Item,
        Items,
        Sampling,
        Tokens,
    )
    from hetnode.protocol.tensors import to_wire

    layers = load_config(tiny_model).num_layers
    net = MemoryNetwork()
    async with trio.open_nursery() as nursery, net.transport("coord") as ct, net.transport("evil") as et:
        servers: dict[str, HopServer] = {}
        async with _nodes(net, nursery, tiny_model, [("a", (0, layers))], servers, {}):
            a = servers["a"]
            coord, evil = RawPeer(ct), RawPeer(et)
            route = pipeline_route(hops_of(("a", 0, layers)))
            meta, raw = to_wire(torch.tensor(PROMPTS[1]))
            with trio.fail_after(30):
                await coord.send("a", Install(session="s", route=route, sampling=Sampling(),
                                              prefill_end=len(PROMPTS[1]), max_tokens=200, lease_s=30))
                await coord.send("a", Items(items=[Item("s", 0, len(PROMPTS[1]))], tensor=meta), raw)
                await coord.next_of(Tokens)
                moved = Route(phases=[Phase(kind="prefill", hops=hops_of(("a", 0, layers)), last_token=3),
                                      Phase(kind="mixed", hops=hops_of(("b", 0, layers)), first_token=3)])
                await evil.send("a", Freeze(session="s"))
                assert (await evil.next_of(ErrorReply))[1].code == "not_yours"
                await evil.send("a", Export(session="s", to="t", route=moved))
                assert (await evil.next_of(ErrorReply))[1].code == "not_yours"
                assert not a.sessions["s"].frozen
                await coord.send("a", Export(session="s", to="t", route=moved))
                _, failed = await coord.next_of(Failed)
                assert failed.session == "t" and "not frozen" in failed.reason and "s" in a.sessions
                await coord.send("a", Freeze(session="s"))
                _, frozen = await coord.next_of(Frozen)
                assert frozen.session == "s" and frozen.end >= len(PROMPTS[1])
                backwards = Route(phases=[Phase(kind="prefill", hops=hops_of(("b", 0, layers)), last_token=3),
                                          Phase(kind="mixed", hops=hops_of(("a", 0, layers)), first_token=3)])
                await coord.send("a", Export(session="s", to="t", route=backwards))
                _, failed = await coord.next_of(Failed)
                assert failed.session == "t" and "first of its two phases" in failed.reason
                assert a.sessions["s"].frozen and a.kv_bytes_sent == 0
        nursery.cancel_scope.cancel()


async def test_layer_group_frames_out_of_place_are_refused_and_touch_no_other_session(tiny_model: Path) -> None:
    """A layer-wise hand-off arrives as a frame per group of layers, each checked on its own: a group sent twice
    (on the same stream or on two at once), one overlapping a group already taken, one with a layer its sender
    does not share with this hop, one that skips positions of its layers, and one for a session whose KV is
    complete are refused with an error and a reset stream. Nothing is written then; another session's KV stays
    as it was; the right groups, in any layer order, still complete the session. A frame that passes the checks
    but cannot be written (a non-finite int8 scale) fails its session: it can no longer be vouched for."""
    import torch
    from raw_peer import RawPeer

    from hetnode.kv.codecs import CODECS
    from hetnode.protocol.framing import FramedStream
    from hetnode.protocol.messages import KV, KV_PROTOCOL, ErrorReply, Failed, Install, Ready, Sampling, TensorMeta
    from hetnode.protocol.messages import kv_decoder as decoder

    cfg = load_config(tiny_model)
    layers, cut, n = cfg.num_layers, 2, 8
    net = MemoryNetwork()
    async with trio.open_nursery() as nursery, net.transport("coord") as ct, net.transport("p0") as p0, \
            net.transport("p1") as p1, net.transport("evil") as evil:
        servers: dict[str, HopServer] = {}
        async with _nodes(net, nursery, tiny_model, [("d", (0, layers))], servers, {}):
            d = servers["d"]
            assert d.loop is not None
            coord = RawPeer(ct)
            route = split_route([("p0", 0, cut), ("p1", cut, layers)], [("d", 0, layers)])
            with trio.fail_after(10):
                for sid in ("s", "t", "u"):
                    await coord.send("d", Install(session=sid, route=route, sampling=Sampling(), prefill_end=n,
                                                  max_tokens=4, lease_s=30))
                    await coord.next_of(Ready)
            kv = {sid: (torch.randn(layers, n, cfg.num_kv_heads, cfg.head_dim),
                        torch.randn(layers, n, cfg.num_kv_heads, cfg.head_dim)) for sid in ("s", "t", "u")}

            def frame(sid: str, first: int, count_layers: int, start: int = 0, count: int = n,
                      codec: str = "fp16") -> tuple[KV, bytes]:
                keys, values = kv[sid]
                part = (slice(first, first + count_layers), slice(start, start + count))
                data = bytes(CODECS[codec].pack(keys[part], values[part]))
                return KV(session=sid, first_layer=first, layers=count_layers, start=start, count=count,
                          codec=codec, tensor=TensorMeta("uint8", [len(data)])), data  # type: ignore[arg-type]

            async def send(transport: Any, *frames: tuple[KV, bytes]) -> FramedStream:
                framed = FramedStream(await transport.open_stream(NodeId("d"), KV_PROTOCOL))
                for msg, data in frames:
                    await framed.send_with_payload(msg, data)
                return framed

            async def refused(transport: Any, *frames: tuple[KV, bytes]) -> str:
                """The frames on one stream; the last must be refused (those before it are taken in order)."""
                framed = await send(transport, *frames)
                with trio.fail_after(10):
                    reply = await framed.receive_msg(decoder)
                assert isinstance(reply, ErrorReply)
                return reply.code

            async def held(sid: str) -> tuple[torch.Tensor, torch.Tensor]:
                return await d.loop.run_engine(lambda e: e.export_kv(sid, 0, n))  # type: ignore[arg-type,union-attr]

            s_before = await held("s")  # (freed blocks are not zeroed: compare with what the reserved ones held)
            # Session t's hand-off completes first, in a frame per layer group from each of its two senders.
            await send(p0, frame("t", 0, 1), frame("t", 1, 1))
            await send(p1, frame("t", 2, 2), frame("t", 4, 1))
            t = d.sessions["t"]
            with trio.fail_after(10):
                await t.kv_done.wait()
            t_before = await held("t")
            assert torch.allclose(t_before[0], kv["t"][0], atol=1e-2)

            s = d.sessions["s"]
            # Layer 0's first half is taken; the same group again, on the same stream, is not.
            assert await refused(p0, frame("s", 0, 1, 0, 4), frame("s", 0, 1, 0, 4)) == "bad_message"
            assert s.kv_next == {0: 4, 1: 0, 2: 0, 3: 0, 4: 0}
            assert await refused(p0, frame("s", 0, 2, 0, 4)) == "bad_message"  # overlaps layer 0's [0, 4)
            assert await refused(p0, frame("s", 1, 2)) == "bad_message"  # layer 2 comes from p1
            assert await refused(p1, frame("s", 1, 2)) == "bad_message"  # and layer 1 from p0
            assert await refused(evil, frame("s", 0, 1, 4, 4)) == "bad_message"  # not on the route
            assert await refused(p0, frame("s", 1, 1, 4, 4)) == "bad_message"  # layer 1 continues at 0
            assert await refused(p0, frame("t", 0, 1, 0, 4)) == "bad_message"  # t's KV is complete
            assert s.kv_next == {0: 4, 1: 0, 2: 0, 3: 0, 4: 0} and s.kv_waiting and not s.kv_done.is_set()
            got = await held("s")
            assert torch.allclose(got[0][0, :4], kv["s"][0][0, :4], atol=1e-2)
            assert torch.equal(got[0][0, 4:], s_before[0][0, 4:]) and torch.equal(got[0][1:], s_before[0][1:])
            assert torch.equal(got[1][1:], s_before[1][1:])  # nothing else was written
            assert all(torch.equal(a, b) for a, b in zip(await held("t"), t_before, strict=True))

            # The same group on two streams at once: one is taken, the other refused.
            replies, inbox = trio.open_memory_channel[str](2)

            async def reply_on(framed: FramedStream) -> None:
                reply = await framed.receive_msg(decoder)  # the taken frame's stream stays quiet
                await replies.send(reply.code if isinstance(reply, ErrorReply) else repr(reply))

            twice = [await send(p0, frame("s", 1, 1)), await send(p0, frame("s", 1, 1))]
            async with trio.open_nursery() as both:
                for framed in twice:
                    both.start_soon(reply_on, framed)
                with trio.fail_after(10):
                    assert await inbox.receive() == "bad_message"
                await trio.testing.wait_all_tasks_blocked()
                assert inbox.statistics().current_buffer_used == 0  # only one of the two was refused
                both.cancel_scope.cancel()
            assert s.kv_next[1] == n

            # The rest, layers last to first: the session is complete and holds exactly what was sent.
            await send(p1, frame("s", 4, 1), frame("s", 2, 2))
            await send(p0, frame("s", 0, 1, 4, 4))
            with trio.fail_after(10):
                await s.kv_done.wait()
            got = await held("s")
            assert torch.allclose(got[0], kv["s"][0], atol=1e-2) and torch.allclose(got[1], kv["s"][1], atol=1e-2)
            assert all(torch.equal(a, b) for a, b in zip(await held("t"), t_before, strict=True))

            # A well-formed frame whose int8 scales are not finite: refused, and its session fails.
            msg, data = frame("u", 0, 1, codec="int8")
            assert await refused(p0, (msg, data[:-2] + b"\xff\x7f")) == "bad_message"
            _, failed = await coord.next_of(Failed)
            assert failed.session == "u" and "could not be written" in failed.reason
            assert "u" not in d.sessions and {"s", "t"} <= set(d.sessions)
        nursery.cancel_scope.cancel()


async def test_the_first_token_never_waits_for_kv_streamed_from_inside_the_step(tiny_model: Path) -> None:
    """Layer-wise, the KV frames are queued while the step runs, on their own outbox and stream: a decode hop that
    never reads its KV stream holds up neither the prefill step nor the first token, which reaches the
    coordinator all the same (the decode waits, as it must, for KV that never comes)."""
    from hetnode.protocol.messages import KV_PROTOCOL

    layers = load_config(tiny_model).num_layers
    async with network(tiny_model, {"p": (0, layers), "d": (0, layers)}, kv_transfer=LAYERWISE) as net:
        stuck = trio.Event()

        async def never_read(stream: Any) -> None:
            stuck.set()
            await trio.sleep_forever()

        net.nodes["d"].transport.set_handler(KV_PROTOCOL, never_read)

        async def fixed(exclude: set[NodeId]) -> Route:
            return split_route([("p", 0, layers)], [("d", 0, layers)])

        net.gen.route_for = fixed
        params = GenerationParams(max_tokens=4, sampling=SamplingParams())
        with trio.fail_after(20):
            async with net.gen.generate(PROMPTS[2], params) as events, aclosing(aiter(events)) as tokens:
                first = await anext(tokens)
                assert first.token is not None
                await stuck.wait()  # the KV went out while the first token did
        p = net.nodes["p"]
        assert p.kv_frames_sent == layers and p.loop is not None and p.loop.steps == 1


@pytest.mark.parametrize("mbps", [1.0, 10_000.0, None])
async def test_a_hop_streams_its_kv_over_a_slow_link_and_sends_it_whole_over_a_fast_one(
        tiny_model: Path, reference: list[list[int]], mbps: float | None) -> None:
    """The transfer policy reads the link's measured bandwidth (the node's probes; None: not measured, taken as
    100 Mbit/s): the 70-token prompt's 50 KB take 400 ms at 1 Mbit/s and stream, 4 ms at 100 Mbit/s and go
    whole."""
    layers = load_config(tiny_model).num_layers
    policy = KVTransferPolicy(min_group_bytes=0, max_groups=1024)  # the default threshold; a frame per layer
    async with network(tiny_model, {"p": (0, layers), "d": (0, layers)}, kv_transfer=policy) as net:
        asked: list[NodeId] = []

        def link_mbps(peer: NodeId) -> float | None:
            asked.append(peer)
            return mbps

        net.nodes["p"].link_mbps = link_mbps

        async def fixed(exclude: set[NodeId]) -> Route:
            return split_route([("p", 0, layers)], [("d", 0, layers)])

        net.gen.route_for = fixed
        assert await collect(net.gen, PROMPTS[2]) == reference[2]
        assert asked == ["d"]
        assert net.nodes["p"].kv_frames_sent == (layers if mbps == 1.0 else 1)
