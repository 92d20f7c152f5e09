"""Every stream handler of the coordinator and of a node, fed hostile frames by a member and by a stranger.

A coordinator and two nodes serve a tiny Llama as a pipeline, over the memory transport and over libp2p (TCP,
Noise, yamux on loopback). Member n2 and a stranger that never joined open streams of every protocol the
coordinator and node n1 serve, and send, per stream, one of: random bytes in a frame, a frame cut short, a frame
over the size limit, valid MessagePack of the wrong shape (a known tag with fields of the wrong types, or not a
map), a well-formed message of another protocol, or (on the data path and KV) a tensor header followed by a
payload of another size or announcing a tensor over the limit. Every stream must get an ErrorReply and then end
(closed or reset); afterwards both peers still serve, and a greedy request gives the same tokens as before the
attack. Frames come from a seeded generator, so a failure replays exactly.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from pathlib import Path

import msgspec
import pytest
import trio

from hetnode.coordinator.daemon import Coordinator, CoordinatorConfig
from hetnode.coordinator.deployment import PlanningConfig
from hetnode.coordinator.generation import GenerationParams
from hetnode.coordinator.local import LocalGenerator
from hetnode.errors import StreamReset
from hetnode.ids import NodeId, ProtocolId
from hetnode.models.resolve import load_config
from hetnode.models.tiny import write_tiny_model
from hetnode.models.tokenizer import load_tokenizer
from hetnode.node.daemon import NodeConfig, NodeDaemon
from hetnode.node.engine import SamplingParams
from hetnode.node.hops import HopServer
from hetnode.protocol import messages as m
from hetnode.protocol.framing import DEFAULT_MAX_FRAME, FramedStream, encode
from hetnode.protocol.identity import load_or_create_identity
from hetnode.protocol.libp2p_transport import open_libp2p_transport
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.transport import Transport

PROFILE = m.HardwareProfile(device="cpu", device_type="cpu", memory_bytes=8 << 30, matmul_tflops=0.1,
                            mem_bandwidth_gbps=20, dtype="float32")
SEED = 1616
STREAMS_PER_HANDLER = 16  # per sender: two of each kind of frame
PROMPT = [5, 6, 7, 8]

# Each protocol's tags that name a message with required fields (one without would take any map of that tag).
TAGS = {p: [c.__struct_config__.tag for c in u.__args__ if c.__struct_config__.tag != "error"
            and len(c.__struct_fields__) > len(c.__struct_defaults__)] for p, u in [
    (m.CTL_PROTOCOL, m.CtlMessage), (m.PROBE_PROTOCOL, m.ProbeMessage), (m.DISCOVER_PROTOCOL, m.DiscoverMessage),
    (m.INFER_PROTOCOL, m.InferMessage), (m.KV_PROTOCOL, m.KVMessage)]}
FOREIGN = {
    m.CTL_PROTOCOL: m.Ping(seq=1),
    m.PROBE_PROTOCOL: m.DiscoverRequest(),
    m.DISCOVER_PROTOCOL: m.Heartbeat(seq=1, load=m.Load()),
    m.INFER_PROTOCOL: m.Ping(seq=2),
    m.KV_PROTOCOL: m.Leave(reason="x"),
}
# The messages that carry a tensor, with a given header (for payloads of the wrong size or over the limit).
TENSOR_MESSAGES: dict[ProtocolId, Callable[[m.TensorMeta], msgspec.Struct]] = {
    m.INFER_PROTOCOL: lambda meta: m.Items(items=[m.Item("s-fuzz", 0, meta.shape[0])], tensor=meta),
    m.KV_PROTOCOL: lambda meta: m.KV(session="s-fuzz", first_layer=0, layers=1, start=0, count=meta.shape[0],
                                     codec="fp16",
                                     tensor=m.TensorMeta(dtype="uint8", shape=[min(meta.nbytes(), 1 << 31)])),
}
KINDS = 8
SERVED = {"coord": [m.CTL_PROTOCOL, m.PROBE_PROTOCOL, m.DISCOVER_PROTOCOL, m.INFER_PROTOCOL],
          "n1": [m.PROBE_PROTOCOL, m.DISCOVER_PROTOCOL, m.INFER_PROTOCOL, m.KV_PROTOCOL]}


def _junk(rng: random.Random) -> object:
    """A value that no field of any message takes: negative, fractional, over-long, or of a container type."""
    return rng.choice([-rng.randint(1, 1 << 62), "x" * rng.randint(5000, 9000), rng.random() + 0.5, None,
                       [rng.random()], {"a": 1}, True])


def _frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def hostile(kind: int, protocol: ProtocolId, rng: random.Random) -> tuple[bytes, bool]:
    """Bytes to send, and whether to close our side after them (the handler must see the stream end early)."""
    if kind == 0:  # random bytes in a well-formed frame
        return _frame(rng.randbytes(rng.randint(0, 200))), False
    if kind == 1:  # a frame cut short: the length says more than ever comes
        whole = _frame(encode(FOREIGN[protocol]))
        return whole[:rng.randint(1, len(whole) - 1)], True
    if kind == 2:  # a length over the limit (what follows must never be read)
        return (DEFAULT_MAX_FRAME + 1 + rng.randint(0, 1 << 30)).to_bytes(4, "big") + b"\0" * 64, False
    if kind == 3:  # a tag the protocol knows, with fields of the wrong types
        tag = rng.choice(TAGS[protocol])
        body = {"t": tag, **{name: _junk(rng) for name in ("session", "seq", "token", "items", "tensor", "load",
                                                           "route", "position", "code", "total_bytes")}}
        return _frame(msgspec.msgpack.encode(body)), False
    if kind == 4:  # valid MessagePack that is not a map at all
        return _frame(msgspec.msgpack.encode(rng.choice([[1, 2, 3], 7, "join", None, 1.5]))), False
    if kind in (6, 7) and protocol in TENSOR_MESSAGES:
        rows = rng.randint(1, 8)
        if kind == 6:  # a tensor header and a payload of another size than it says
            header = encode(TENSOR_MESSAGES[protocol](m.TensorMeta(dtype="float16", shape=[rows, 64])))
            return _frame(header) + _frame(b"\0" * (rows * 128 + rng.choice([-1, 1, 64]))), False
        # kind 7: a header announcing a tensor over the limit (its bytes must never be awaited)
        header = encode(TENSOR_MESSAGES[protocol](m.TensorMeta(dtype="float32", shape=[1 << 20, 1 << 12])))
        return _frame(header) + b"\0" * 64, False
    return _frame(encode(FOREIGN[protocol])), False  # a well-formed message of another protocol


async def attack(sender: Transport, target: NodeId, protocol: ProtocolId, kind: int, rng: random.Random,
                 replies: list[str]) -> None:
    data, close = hostile(kind, protocol, rng)
    stream = await sender.open_stream(target, protocol)
    framed = FramedStream(stream)
    with trio.fail_after(30):  # a hang here is a failure, not a slow test
        try:
            await stream.send_all(data)
            if close:
                await stream.close()
        except StreamReset:
            pass  # the handler may refuse before reading everything; its reply is still readable
        reply = await framed.receive_msg(_error_decoder)
        assert isinstance(reply, m.ErrorReply), f"{protocol} on {target}, kind {kind}: {reply!r}"
        with suppress(StreamReset):  # then the stream ends: a clean end or a reset, nothing more
            assert await framed.receive_frame() is None
    replies.append(reply.code)


_error_decoder = msgspec.msgpack.Decoder(m.ErrorReply)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", "llama", num_layers=2)


async def tokens(gen: object, prompt: list[int]) -> list[int]:
    params = GenerationParams(max_tokens=8, sampling=SamplingParams())
    async with gen.generate(prompt, params) as events:  # type: ignore[attr-defined]
        return [e.token async for e in events]


@asynccontextmanager
async def transports(kind: str) -> AsyncIterator[dict[str, Transport]]:
    """coord, n1, n2 and a stranger, over the memory transport or over libp2p (TCP, Noise, yamux) on loopback."""
    async with AsyncExitStack() as stack:
        if kind == "memory":
            net = MemoryNetwork()
            yield {name: await stack.enter_async_context(net.transport(name)) for name in NAMES}
        else:
            ts = {name: await stack.enter_async_context(open_libp2p_transport(
                load_or_create_identity(None), ["/ip4/127.0.0.1/tcp/0"])) for name in NAMES}
            for t in ts.values():  # every peer can dial every other (the stranger learns them as any dialer can)
                for other in ts.values():
                    if other is not t:
                        t.add_peer_addrs(other.peer_id, other.listen_addrs())
            yield ts


NAMES = ("coord", "n1", "n2", "stranger")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["memory", "libp2p"])
async def test_every_handler_survives_hostile_frames_from_members_and_strangers(tiny_model: Path, kind: str) -> None:
    cfg = load_config(tiny_model)
    async with transports(kind) as ts, trio.open_nursery() as nursery:
        ct, t2, stranger = ts["coord"], ts["n2"], ts["stranger"]
        coord = Coordinator(CoordinatorConfig(token="t", probe_interval_s=3600), ct)
        gen = coord.enable_serving(model=str(tiny_model), model_config=cfg, tokenizer=load_tokenizer(tiny_model),
                                   planning=PlanningConfig(method="pipeline"))
        await nursery.start(coord.run)
        nodes: list[NodeDaemon] = []
        for name in ("n1", "n2"):
            t = ts[name]
            hops = HopServer(t, _member_check(nodes, len(nodes)))
            node = NodeDaemon(NodeConfig(bootstrap=(ct.listen_addrs()[0],), token="t", name=name,
                                         profile=PROFILE), t, hops)
            nodes.append(node)
            await nursery.start(hops.run)
            await nursery.start(node.run)
        assert coord.deployment is not None and await coord.deployment.wait_ready(60) is not None
        assert len(coord.deployment.plan.shards) == 2  # type: ignore[union-attr]
        before = await tokens(gen, PROMPT)
        assert coord.registry.is_member(t2.peer_id) and not coord.registry.is_member(stranger.peer_id)

        rng = random.Random(SEED)
        replies: dict[tuple[str, str, str], list[str]] = {}
        for target_name, protocols in SERVED.items():
            target = ts[target_name].peer_id
            for protocol in protocols:
                for sender_name, sender in (("member", t2), ("stranger", stranger)):
                    got = replies[(target_name, protocol, sender_name)] = []
                    async with trio.open_nursery() as attacks:
                        for i in range(STREAMS_PER_HANDLER):
                            attacks.start_soon(attack, sender, target, protocol, i % KINDS,
                                               random.Random(rng.random()), got)
        assert all(len(codes) == STREAMS_PER_HANDLER for codes in replies.values())
        # Strangers are turned away before their frames are read, except where the protocol is public.
        assert set(replies[("n1", m.INFER_PROTOCOL, "stranger")]) == {"not_member"}
        assert set(replies[("coord", m.PROBE_PROTOCOL, "stranger")]) == {"not_member"}
        assert "bad_message" in replies[("n1", m.INFER_PROTOCOL, "member")]
        assert "bad_message" in replies[("coord", m.DISCOVER_PROTOCOL, "stranger")]

        # Both peers are alive and members, and serve the same greedy tokens as before.
        assert coord.registry.is_member(ts["n1"].peer_id) and coord.registry.is_member(t2.peer_id)
        assert await tokens(gen, PROMPT) == before
        nursery.cancel_scope.cancel()


def _member_check(nodes: list[NodeDaemon], i: int) -> Callable[[NodeId], bool]:
    return lambda peer: nodes[i].is_member(peer)


# The data path's messages that start a queued KV hand-off (ThunderServe's KV queues), malformed: fields of the
# wrong type, a session id over its bound, the field missing. (Fields a message does not have are ignored, as
# msgspec does for every message: a newer peer may add some.)
QUEUE_TAGS = ("reserve", "send_kv")
MALFORMED = [{"session": 7}, {"session": "s" * 129}, {}, {"session": None}, {"session": ["s"]}, {"session": b"s"}]


async def test_the_queued_hand_off_messages_malformed_or_out_of_turn_get_an_error_and_touch_no_kv(
        tiny_model: Path) -> None:
    """A node's data path fed Reserve and SendKV (and an Install that queues KV) by a member that is not the
    coordinator, malformed and well-formed, and by a stranger: each malformed one gets an ErrorReply
    (bad_message) and its stream ends; a well-formed one from anyone but the session's coordinator gets
    not_yours (not_coordinator for the Install) and changes nothing; the stranger is turned away unread; the node
    reserves no KV for any of it and serves its coordinator's session afterwards as before."""
    import torch
    from raw_peer import RawPeer

    from hetnode.node.engine import EngineConfig
    from hetnode.protocol.routes import pipeline_route
    from hetnode.protocol.tensors import to_wire

    layers = load_config(tiny_model).num_layers
    net = MemoryNetwork()
    async with (trio.open_nursery() as nursery, net.transport("coord") as ct, net.transport("n1") as t1,
                net.transport("n2") as t2, net.transport("stranger") as ts):
        hops = HopServer(t1, lambda peer: peer in ("coord", "n2"), engine_config=EngineConfig(num_kv_blocks=64,
                                                                                              block_size=4))
        hops.is_coordinator = lambda peer: peer == "coord"
        await nursery.start(hops.run)

        async def report(status: m.AssignmentStatus) -> None:
            assert status.state != "failed", status.detail

        await hops.assign(m.Assignment(plan_version=1, model=str(tiny_model), first_layer=0, last_layer=layers,
                                       role="mixed"), report)
        coord, member = RawPeer(ct), RawPeer(t2)
        route = pipeline_route([m.Hop(peer="n1", first_layer=0, last_layer=layers)])
        meta, raw = to_wire(torch.tensor(PROMPT))
        with trio.fail_after(60):
            await coord.send("n1", m.Install(session="s", route=route, sampling=m.Sampling(),
                                             prefill_end=len(PROMPT), max_tokens=3, lease_s=30))
            await coord.send("n1", m.Items(items=[m.Item("s", 0, len(PROMPT))], tensor=meta), raw)
            _, first = await coord.next_of(m.Tokens)
            codes: list[str] = []
            for tag in QUEUE_TAGS:
                for fields in MALFORMED:
                    for sender in (t2, ts):
                        framed = FramedStream(await sender.open_stream(t1.peer_id, m.INFER_PROTOCOL))
                        await framed.send_frame(msgspec.msgpack.encode({"t": tag, **fields}))
                        reply = await framed.receive_msg(_error_decoder)
                        assert isinstance(reply, m.ErrorReply), (tag, fields)
                        codes.append(reply.code)
                        with suppress(StreamReset):
                            await framed.stream.close()  # (the node waits a moment for our side's end)
                            assert await framed.receive_frame() is None
            assert set(codes) == {"bad_message", "not_member"}
            assert codes.count("not_member") == len(codes) // 2  # every stranger's stream, unread
            for msg in (m.Reserve(session="s"), m.SendKV(session="s"), m.Reserve(session="unknown")):
                await member.send("n1", msg)
                assert (await member.next_of(m.ErrorReply))[1].code == "not_yours"
            split = m.Route(phases=[m.Phase(kind="prefill", hops=route.phases[0].hops),
                                    m.Phase(kind="decode", hops=[m.Hop(peer="n2", first_layer=0,
                                                                       last_layer=layers)])])
            await member.send("n1", m.Install(session="q", route=split, sampling=m.Sampling(), prefill_end=3,
                                              max_tokens=3, lease_s=30, kv_queued=True))
            assert (await member.next_of(m.ErrorReply))[1].code == "not_coordinator"
            # Nothing of it reached the KV: the one session holds what its prefill took, and runs on.
            assert set(hops.sessions) == {"s"} and hops.loop is not None
            assert list(hops.loop.ledger.sessions()) == ["s"] and hops.kv_bytes_sent == 0
            got = [first.tokens[0].token]
            while len(got) < 3:
                _, more = await coord.next_of(m.Tokens)
                got += [t.token for t in more.tokens]
        nursery.cancel_scope.cancel()
    async with LocalGenerator.open(tiny_model) as local:
        params = GenerationParams(max_tokens=3, sampling=SamplingParams())
        async with local.generate(PROMPT, params) as events:
            assert got == [e.token async for e in events]
