"""Link emulation over the in-memory transport: timings checked exactly under trio's MockClock."""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from hetnode.errors import StreamClosed, StreamReset
from hetnode.ids import NodeId, ProtocolId
from hetnode.planner.cluster import UNLIMITED, LinkSpec
from hetnode.protocol.memory import MemoryNetwork, MemoryTransport
from hetnode.protocol.shaping import (
    PACKET_BYTES,
    STUCK_GRACE_S,
    LinkFor,
    ShapedTransport,
    _on_real_time,
    shaped_transport,
)
from hetnode.protocol.transport import Handler, Stream

P = ProtocolId("/test/1")
MB = 1_000_000
EPS = 1e-9
# 1 MB at 80 Mbit/s is exactly 0.1 s of serialization.
LINK = LinkSpec(bandwidth_mbps=80, latency_ms=30)


@asynccontextmanager
async def shaped_peers(link: LinkSpec | None, names: tuple[str, ...] = ("a", "b"),
                       **kwargs: int) -> AsyncIterator[list[ShapedTransport]]:
    net = MemoryNetwork()
    async with _shaped(net, list(names), lambda local, remote: link, kwargs) as peers:
        yield peers


@asynccontextmanager
async def _shaped(net: MemoryNetwork, names: list[str], link_for: LinkFor,
                  kwargs: dict[str, int]) -> AsyncIterator[list[ShapedTransport]]:
    """Memory peers named `names`, each wrapped in link emulation."""
    if not names:
        yield []
        return
    async with net.transport(names[0]) as inner, shaped_transport(inner, link_for, **kwargs) as outer, \
            _shaped(net, names[1:], link_for, kwargs) as rest:
        yield [outer, *rest]


async def read_to_eof(stream: Stream) -> bytes:
    buf = bytearray()
    while chunk := await stream.receive_some(1 << 20):
        buf += chunk
    return bytes(buf)


def sink(results: trio.MemorySendChannel[tuple[float, bytes]]) -> Handler:
    """A handler that reads to EOF and reports (time of EOF, bytes read)."""
    async def handler(stream: Stream) -> None:
        data = await read_to_eof(stream)
        await results.send((trio.current_time(), data))
    return handler


async def echo(stream: Stream) -> None:
    while chunk := await stream.receive_some():
        await stream.send_all(chunk)
    await stream.close()


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


async def test_one_megabyte_takes_serialization_plus_latency(autojump_clock: trio.testing.MockClock) -> None:
    send, results = trio.open_memory_channel[tuple[float, bytes]](1)
    async with shaped_peers(LINK) as (a, b):
        b.set_handler(P, sink(send))
        stream = await a.open_stream(NodeId("b"), P)
        t0 = trio.current_time()
        data = payload(MB)
        await stream.send_all(data)
        before_close = trio.current_time()
        await stream.close()
        assert trio.current_time() == before_close  # close does not wait for delivery
        done, received = await results.receive()
    assert received == data
    # Pipelined: 16 chunks, yet the latency is paid once.
    assert done - t0 == pytest.approx(0.1 + LINK.latency_s, abs=EPS)


async def test_open_stream_pays_two_round_trips(autojump_clock: trio.testing.MockClock) -> None:
    async with shaped_peers(LINK) as (a, b):
        b.set_handler(P, echo)
        t0 = trio.current_time()
        await a.open_stream(NodeId("b"), P)
        assert trio.current_time() - t0 == pytest.approx(4 * LINK.latency_s, abs=EPS)
    async with shaped_peers(LINK, open_rtts=0) as (a, b):
        b.set_handler(P, echo)
        t0 = trio.current_time()
        await a.open_stream(NodeId("b"), P)
        assert trio.current_time() == t0


async def test_ping_pong_round_trip_is_twice_the_latency(autojump_clock: trio.testing.MockClock) -> None:
    async with shaped_peers(LINK) as (a, b):
        b.set_handler(P, echo)
        stream = await a.open_stream(NodeId("b"), P)
        for _ in range(3):
            t0 = trio.current_time()
            await stream.send_all(b"p")
            assert await stream.receive_some() == b"p"
            # One byte each way: 0.1 us of serialization per direction on top of the latency.
            one_byte = 8 / (LINK.bandwidth_mbps * 1e6)
            assert trio.current_time() - t0 == pytest.approx(2 * LINK.latency_s + 2 * one_byte, abs=EPS)


async def test_concurrent_streams_to_one_peer_share_its_bandwidth(
        autojump_clock: trio.testing.MockClock) -> None:
    send, results = trio.open_memory_channel[tuple[float, bytes]](2)
    async with shaped_peers(LINK) as (a, b):
        b.set_handler(P, sink(send))
        streams = [await a.open_stream(NodeId("b"), P) for _ in range(2)]
        t0 = trio.current_time()

        async def push(stream: Stream, seed: int) -> None:
            await stream.send_all(payload(MB, seed))
            await stream.close()

        async with trio.open_nursery() as nursery:
            for seed, stream in enumerate(streams):
                nursery.start_soon(push, stream, seed)
        outcomes = sorted([await results.receive() for _ in streams])
    assert sorted(data for _, data in outcomes) == sorted([payload(MB, 0), payload(MB, 1)])
    chunk_time = 65536 * 8 / 80e6
    for done, _ in outcomes:
        # Both finish together (within one chunk): an even share, not one stream after the other.
        elapsed = done - t0 - LINK.latency_s
        assert 0.2 - chunk_time - EPS <= elapsed <= 0.2 + EPS


async def test_links_to_different_peers_and_directions_do_not_share(
        autojump_clock: trio.testing.MockClock) -> None:
    send, results = trio.open_memory_channel[tuple[float, bytes]](3)
    async with shaped_peers(LINK, names=("a", "b", "c")) as (a, b, c):
        for peer in (a, b, c):
            peer.set_handler(P, sink(send))
        pairs = [(a, "b"), (a, "c"), (b, "a")]
        streams = [await src.open_stream(NodeId(dst), P) for src, dst in pairs]
        t0 = trio.current_time()

        async def push(stream: Stream) -> None:
            await stream.send_all(payload(MB))
            await stream.close()

        async with trio.open_nursery() as nursery:
            for stream in streams:
                nursery.start_soon(push, stream)
        for _ in streams:
            done, data = await results.receive()
            assert data == payload(MB)
            assert done - t0 == pytest.approx(0.1 + LINK.latency_s, abs=EPS)


async def test_many_small_writes_arrive_in_order(autojump_clock: trio.testing.MockClock) -> None:
    rng = random.Random(7)
    writes = [payload(rng.choice([0, 1, 7, 1000, 65536, 65537, 200_000]), seed=i) for i in range(60)]
    send, results = trio.open_memory_channel[tuple[float, bytes]](1)
    async with shaped_peers(LinkSpec(bandwidth_mbps=50, latency_ms=5, loss=0.05), seed=3) as (a, b):
        b.set_handler(P, sink(send))
        stream = await a.open_stream(NodeId("b"), P)
        for w in writes:
            await stream.send_all(memoryview(bytearray(w)))
        await stream.close()
        _, received = await results.receive()
    assert received == b"".join(writes)


async def test_a_lost_packet_costs_a_round_trip_and_its_resend(autojump_clock: trio.testing.MockClock) -> None:
    lossy = LinkSpec(bandwidth_mbps=80, latency_ms=30, loss=0.3)
    packet = PACKET_BYTES * 8 / 80e6

    def link_for(local: NodeId, remote: NodeId) -> LinkSpec:
        return lossy if local == "a" else LINK  # only a -> b loses packets

    net = MemoryNetwork()
    async with _shaped(net, ["a", "b"], link_for, {"seed": 5}) as (a, b):
        b.set_handler(P, echo)
        stream = await a.open_stream(NodeId("b"), P)
        rtts = []
        for _ in range(200):
            t0 = trio.current_time()
            await stream.send_all(bytes(PACKET_BYTES))  # one packet, so lost once or not at all
            received = 0
            while received < PACKET_BYTES:
                received += len(await stream.receive_some())
            rtts.append(trio.current_time() - t0)
    clean = 2 * LINK.latency_s + 2 * packet
    recovered = clean + 2 * lossy.latency_s + packet
    lost = sum(rtt == pytest.approx(recovered, abs=EPS) for rtt in rtts)
    assert lost + sum(rtt == pytest.approx(clean, abs=EPS) for rtt in rtts) == len(rtts)
    assert 0.2 < lost / len(rtts) < 0.4


async def test_losses_are_seeded(autojump_clock: trio.testing.MockClock) -> None:
    lossy = LinkSpec(bandwidth_mbps=80, latency_ms=30, loss=0.01)

    async def transfer_time(seed: int) -> float:
        send, results = trio.open_memory_channel[tuple[float, bytes]](1)
        async with shaped_peers(lossy, seed=seed) as (a, b):
            b.set_handler(P, sink(send))
            stream = await a.open_stream(NodeId("b"), P)
            t0 = trio.current_time()
            await stream.send_all(payload(MB))
            await stream.close()
            done, _ = await results.receive()
        return done - t0

    times = [await transfer_time(seed) for seed in (1, 1, 2, 3)]
    assert times[0] == pytest.approx(times[1], abs=EPS)
    # 1% of 691 packets resent take about 7% more link time, and the last chunks' losses add round trips.
    assert all(t > 0.1 + lossy.latency_s for t in times)
    assert len({round(t, 6) for t in times[1:]}) > 1


async def test_close_then_send_raises_and_close_reset_are_idempotent(
        autojump_clock: trio.testing.MockClock) -> None:
    send, results = trio.open_memory_channel[tuple[float, bytes]](1)
    async with shaped_peers(LINK) as (a, b):
        b.set_handler(P, sink(send))
        stream = await a.open_stream(NodeId("b"), P)
        await stream.send_all(b"x")
        await stream.close()
        await stream.close()
        with pytest.raises(StreamClosed):
            await stream.send_all(b"y")
        _, received = await results.receive()
        assert received == b"x"
        await stream.reset()
        await stream.reset()
        with pytest.raises(StreamReset):
            await stream.send_all(b"z")


async def test_reset_is_immediate_here_and_reaches_the_remote_behind_the_bytes_on_the_wire(
        autojump_clock: trio.testing.MockClock) -> None:
    seen: list[tuple[float, int]] = []  # (time, bytes read so far); the last entry is when the reset came
    handled = trio.Event()

    async def record(stream: Stream) -> None:
        total = 0
        try:
            while chunk := await stream.receive_some(1 << 20):
                total += len(chunk)
                seen.append((trio.current_time(), total))
        finally:
            seen.append((trio.current_time(), total))
            handled.set()

    async with shaped_peers(LINK) as (a, b):
        b.set_handler(P, record)
        stream = await a.open_stream(NodeId("b"), P)
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:

            async def write() -> None:
                with pytest.raises(StreamReset):
                    await stream.send_all(payload(MB))  # would take 0.1 s

            nursery.start_soon(write)
            await trio.sleep(0.05)
            await stream.reset()
            t_reset = trio.current_time()
            with pytest.raises(StreamReset):
                await stream.receive_some()
            assert trio.current_time() == t_reset  # immediate for us
        await handled.wait()
    chunk_time = 65536 * 8 / 80e6
    reset_seen, read = seen[-1]
    # The reset travels one latency, behind the chunk that was on the wire when it was sent.
    assert t_reset + LINK.latency_s - EPS <= reset_seen <= t_reset + LINK.latency_s + chunk_time + EPS
    # What was serialized by then arrives; what was still waiting for the link never does.
    on_the_wire = (t_reset - t0) * LINK.bytes_per_s
    assert on_the_wire - 2 * 65536 <= read <= on_the_wire + 65536


async def test_local_reset_wakes_a_blocked_local_reader(autojump_clock: trio.testing.MockClock) -> None:
    async def stall(stream: Stream) -> None:
        await trio.sleep_forever()

    async with shaped_peers(LINK) as (a, b):
        b.set_handler(P, stall)
        stream = await a.open_stream(NodeId("b"), P)
        woken_at: list[float] = []

        async def read() -> None:
            with pytest.raises(StreamReset):
                await stream.receive_some()
            woken_at.append(trio.current_time())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(read)
            await trio.testing.wait_all_tasks_blocked()
            t_reset = trio.current_time()
            await stream.reset()
        assert woken_at == [t_reset]


class _SpyStream:
    """Records what the shaping layer does to the inner stream, and when."""

    def __init__(self, inner: Stream, ops: list[tuple[str, float]]) -> None:
        self.inner = inner
        self.ops = ops
        self.remote_peer = inner.remote_peer
        self.protocol_id = inner.protocol_id

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        return await self.inner.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)
        self.ops.append((f"send {bytes(data)!r}", trio.current_time()))

    async def close(self) -> None:
        await self.inner.close()
        self.ops.append(("close", trio.current_time()))

    async def reset(self) -> None:
        await self.inner.reset()
        self.ops.append(("reset", trio.current_time()))


class _SpyTransport:
    def __init__(self, inner: MemoryTransport, ops: list[tuple[str, float]]) -> None:
        self.inner = inner
        self.ops = ops

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def open_stream(self, peer: NodeId, protocol_id: ProtocolId) -> Stream:
        return _SpyStream(await self.inner.open_stream(peer, protocol_id), self.ops)


async def test_close_then_reset_delivers_data_then_eof_then_reset(autojump_clock: trio.testing.MockClock) -> None:
    # A last error reply is sent, closed and reset at once (FramedStream.reject); some stacks keep data that
    # precedes a FIN readable after a reset, so all three must reach the inner stream, in order.
    ops: list[tuple[str, float]] = []
    net = MemoryNetwork()
    async with net.transport("a") as ia, net.transport("b") as ib, \
            shaped_transport(_SpyTransport(ia, ops), lambda x, y: LINK) as a:  # type: ignore[arg-type]
        ib.set_handler(P, echo)
        stream = await a.open_stream(NodeId("b"), P)
        t0 = trio.current_time()
        await stream.send_all(b"reply")
        await stream.close()
        await stream.reset()
        await trio.sleep(1)
    due = t0 + LINK.latency_s + 5 * 8 / 80e6
    assert [op for op, _ in ops] == ["send b'reply'", "close", "reset"]
    assert all(t == pytest.approx(due, abs=EPS) for _, t in ops)


async def test_a_reset_discards_what_a_stalled_remote_has_not_taken(
        autojump_clock: trio.testing.MockClock) -> None:
    release = trio.Event()
    outcome: list[BaseException] = []

    async def stall_then_read(stream: Stream) -> None:
        await release.wait()
        try:
            await read_to_eof(stream)
        except StreamReset as exc:
            outcome.append(exc)

    fast = LinkSpec(bandwidth_mbps=1000, latency_ms=10)
    async with shaped_peers(fast) as (a, b):
        b.set_handler(P, stall_then_read)
        stream = await a.open_stream(NodeId("b"), P)
        with trio.move_on_after(1):  # the memory pipe and the delivery queue fill up, then the writer waits
            await stream.send_all(bytes(64 << 20))
        assert a.streams  # the delivery task is stuck behind the stalled reader
        await stream.reset()
        await trio.sleep(fast.latency_s + STUCK_GRACE_S)  # emulated: the reset's trip, and the grace
        await trio.testing.wait_all_tasks_blocked()
        assert not a.streams  # it gave up the undelivered data when the reset arrived
        release.set()
    assert len(outcome) == 1


async def test_remote_reset_is_noticed_by_the_writer(autojump_clock: trio.testing.MockClock) -> None:
    reset_done = trio.Event()

    async def reset_at_once(stream: Stream) -> None:
        await stream.reset()
        reset_done.set()

    async with shaped_peers(LINK) as (a, b):
        b.set_handler(P, reset_at_once)
        stream = await a.open_stream(NodeId("b"), P)
        await reset_done.wait()
        with pytest.raises(StreamReset):
            await stream.receive_some()
        # The first write is already on its way when its delivery fails; the next one knows.
        await stream.send_all(b"1")
        await trio.sleep(2 * LINK.latency_s)  # emulated time, for the write to reach the far end
        with pytest.raises(StreamReset):
            await stream.send_all(b"2")


async def test_a_failing_handler_resets_its_stream_behind_its_data(
        autojump_clock: trio.testing.MockClock) -> None:
    async def fail_after_writing(stream: Stream) -> None:
        await stream.send_all(b"partial reply")
        raise RuntimeError("handler bug")

    async with shaped_peers(LINK) as (a, b):
        b.set_handler(P, fail_after_writing)
        stream = await a.open_stream(NodeId("b"), P)
        t0 = trio.current_time()
        received = b""
        with pytest.raises(StreamReset):
            while True:
                received += await stream.receive_some()
        # Whether the reader takes the bytes before the reset discards them is a race, as with a real stack.
        assert b"partial reply".startswith(received)
        assert trio.current_time() - t0 == pytest.approx(LINK.latency_s, abs=1e-5)


class _ResetOnReturn:
    """An inner transport that ends a handler's stream when the handler returns (as a stricter one may)."""

    def __init__(self, inner: MemoryTransport) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def set_handler(self, protocol_id: ProtocolId, handler: Handler) -> None:
        async def then_reset(stream: Stream) -> None:
            await handler(stream)
            await stream.reset()
        self.inner.set_handler(protocol_id, then_reset)


async def test_handler_output_is_flushed_before_the_handler_counts_as_done(
        autojump_clock: trio.testing.MockClock) -> None:
    async def reply_and_return(stream: Stream) -> None:
        await stream.send_all(payload(MB))
        await stream.close()

    net = MemoryNetwork()
    async with net.transport("a") as ia, net.transport("b") as ib, \
            shaped_transport(ia, lambda x, y: LINK) as a, \
            shaped_transport(_ResetOnReturn(ib), lambda x, y: LINK) as b:  # type: ignore[arg-type]
        b.set_handler(P, reply_and_return)
        stream = await a.open_stream(NodeId("b"), P)
        assert await read_to_eof(stream) == payload(MB)


async def test_a_full_receiver_pushes_back_on_the_writer(autojump_clock: trio.testing.MockClock) -> None:
    never_read = trio.Event()

    async def stall(stream: Stream) -> None:
        await never_read.wait()

    async with shaped_peers(LinkSpec(bandwidth_mbps=1000, latency_ms=1)) as (a, b):
        b.set_handler(P, stall)
        stream = await a.open_stream(NodeId("b"), P)
        t0 = trio.current_time()
        with trio.move_on_after(60) as scope:  # the whole write would need 0.54 s if it could flow
            await stream.send_all(bytes(64 << 20))
        assert scope.cancelled_caught
        assert trio.current_time() - t0 == pytest.approx(60)
        never_read.set()


async def test_disconnect_drops_pending_data(autojump_clock: trio.testing.MockClock) -> None:
    async with shaped_peers(LINK) as (a, b):
        b.set_handler(P, echo)
        stream = await a.open_stream(NodeId("b"), P)
        await stream.send_all(b"lost")
        await a.disconnect(NodeId("b"))
        with pytest.raises(StreamReset):
            await stream.receive_some()
        assert not a.streams


@pytest.mark.parametrize("link", [None, UNLIMITED])
async def test_unshaped_links_pass_through(autojump_clock: trio.testing.MockClock,
                                           link: LinkSpec | None) -> None:
    async with shaped_peers(link) as (a, b):
        b.set_handler(P, echo)
        t0 = trio.current_time()
        stream = await a.open_stream(NodeId("b"), P)
        await stream.send_all(payload(MB))
        await stream.close()
        assert await read_to_eof(stream) == payload(MB)
        assert trio.current_time() == t0
        assert not a.streams


async def test_real_time_throughput_is_within_15_percent() -> None:
    link = LinkSpec(bandwidth_mbps=80, latency_ms=5)
    data = payload(2 * MB)  # 0.2 s at 80 Mbit/s
    send, results = trio.open_memory_channel[tuple[float, bytes]](1)
    async with shaped_peers(link) as (a, b):
        b.set_handler(P, sink(send))
        stream = await a.open_stream(NodeId("b"), P)
        t0 = trio.current_time()  # without a MockClock, trio's clock is the real one
        await stream.send_all(data)
        await stream.close()
        done, received = await results.receive()
    assert received == data
    measured_mbps = len(data) * 8 / (done - t0 - link.latency_s) / 1e6
    assert math.isclose(measured_mbps, link.bandwidth_mbps, rel_tol=0.15), measured_mbps


async def test_default_clock_is_real_time() -> None:
    # Only the real clock wakes late (epoll rounds timeouts up), so only there is lateness compensated.
    assert _on_real_time()


async def test_mock_clock_is_not_real_time(autojump_clock: trio.testing.MockClock) -> None:
    assert not _on_real_time()
