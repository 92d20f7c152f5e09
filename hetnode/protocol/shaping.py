"""Wide-area link emulation that wraps any Transport: bandwidth, one-way latency and packet loss per link.

Each peer shapes only what it sends, so a link's round trip is twice its one-way latency and each direction
has the full bandwidth, as on a real full-duplex path. `link_for(local, remote)` gives the link to emulate
(None, or `LinkSpec.unlimited`, leaves the streams to that peer untouched).

The model, per directed link local -> remote:

- Bandwidth. Every stream toward the same remote shares one serializer: a write is cut into chunks (64 KiB by
  default, so a 1 MB frame is paced smoothly), and each chunk takes the link for `bytes * 8 / bandwidth`
  seconds, starting when the link is next free. Streams that write at the same time therefore interleave
  chunk by chunk and share the bandwidth evenly.
- Latency. A chunk reaches the inner stream `latency` after its serialization ends. Delivery is pipelined:
  one delivery task per stream, fed by a bounded channel sized to the bandwidth-delay product, releases
  chunks in order at their due times while the writer already serializes the next ones, so latency delays
  data but never limits throughput. A full channel (the receiver stopped reading, so the inner stream
  blocks) pushes back on the writer.
- Loss. Each packet (`PACKET_BYTES` of payload) is lost with probability `loss`, drawn from a generator
  seeded by (seed, local, remote). A chunk that lost packets arrives one round trip late (the sender learns
  of the loss from duplicate acknowledgements, as in TCP fast retransmit) plus the time to send the lost
  packets again, which also occupy the link. Later chunks of the same stream wait behind it (TCP delivers in
  order). Timeouts, congestion-window collapse and losses of retransmissions are not modelled.
- Stream opening pays `open_rtts` round trips first: py-libp2p's multistream-select does a handshake and
  then a protocol selection, each a round trip, before either side sees data. Dialing is not shaped.

Stream semantics match the Transport interface, shifted by the emulated delays, as on a real network:

- `close()` returns at once; the remote reads EOF after the data sent before it.
- `reset()` is immediate for us (our reads and writes raise StreamReset, a blocked reader wakes). Data that
  was still waiting for its turn on the link is dropped; chunks already on the wire, and a FIN sent before,
  reach the remote first, and the reset itself arrives one latency later. A remote that stopped reading
  loses what it had not taken `STUCK_GRACE_S` after the reset arrived.
- A reset by the remote is noticed when a delivery fails, so a write queued after it succeeds and the next
  one raises StreamReset (the reset needs a trip to arrive on a real network, too).
- A handler runs under `run_guarded` on the shaped stream, so a failing handler's reset travels behind the
  data it had written; when a handler returns, its output reaches the inner stream before the inner
  transport sees the handler finish (an inner transport may close the stream then).

This wrapper passes tests/protocol/test_transport_conformance.py over both inner transports.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Literal

import trio

from hetnode.errors import StreamClosed, StreamReset
from hetnode.ids import NodeId, ProtocolId
from hetnode.protocol.link_conditions import LinkSpec
from hetnode.protocol.transport import Handler, Stream, Transport, run_guarded

log = logging.getLogger(__name__)

CHUNK_SIZE = 64 * 1024
PACKET_BYTES = 1448  # TCP payload of one 1500-byte Ethernet frame with timestamps
# Chunks queued for delivery per stream: at least this many, and at most MAX_QUEUE (32 MiB of 64 KiB chunks).
MIN_QUEUE = 16
MAX_QUEUE = 512
# After a reset has arrived, a delivery still blocked this long (the remote stopped reading) is abandoned:
# the remote discards what it had not read anyway. The grace lets chunks that arrive together with the reset
# go first, as they would on the wire.
STUCK_GRACE_S = 0.05
# CPython rounds epoll timeouts up to whole milliseconds, so a trio sleep on the real clock wakes about 1 ms
# late (measured here: median 1.0 ms), and later still when the process waits for a busy core. Each shaped
# direction would add that to its latency, so deliveries wake early by the lateness observed so far (a moving
# average, bounded). MockClock has exact time: nothing to compensate there.
REAL_CLOCK_LATENESS_S = 0.001
MAX_LATENESS_S = 0.005


def _on_real_time() -> bool:
    """Whether the running clock's seconds are wall seconds, as with trio's default clock.

    Asked of the clock itself rather than by its type, so that production code need not import
    trio.testing: a virtual clock such as MockClock (rate 0) sleeps no wall time at all, and its deadlines
    are met exactly."""
    clock = trio.lowlevel.current_clock()
    return abs(clock.deadline_to_sleep_time(clock.current_time() + 1.0) - 1.0) < 0.5


class _Lateness:
    """How late sleep_until wakes on this process's clock, learned from the wake-ups themselves."""

    def __init__(self) -> None:
        self.estimate = REAL_CLOCK_LATENESS_S

    def current(self) -> float:
        return self.estimate if _on_real_time() else 0.0

    def observe(self, asked: float, woke: float) -> None:
        if _on_real_time():
            late = min(max(woke - asked, 0.0), MAX_LATENESS_S)
            self.estimate = 0.8 * self.estimate + 0.2 * late


_lateness = _Lateness()

LinkFor = Callable[[NodeId, NodeId], LinkSpec | None]


class _Link:
    """One directed link's serializer: the time at which it is next free, and its loss draws."""

    def __init__(self, spec: LinkSpec, rng: random.Random) -> None:
        self.spec = spec
        self._rng = rng
        self._next_free = -math.inf
        self._seconds_per_byte = 8 / (spec.bandwidth_mbps * 1e6)

    def reserve(self, nbytes: int, now: float) -> tuple[float, float]:
        """Book the link for nbytes; returns (when serialization starts, when the bytes arrive)."""
        start = max(now, self._next_free)
        end = start + nbytes * self._seconds_per_byte
        arrive = end + self.spec.latency_s
        lost = self._lost_packets(nbytes)
        if lost:
            resend = lost * PACKET_BYTES * self._seconds_per_byte
            end += resend
            arrive += 2 * self.spec.latency_s + resend
        self._next_free = end
        return start, arrive

    def _lost_packets(self, nbytes: int) -> int:
        p = self.spec.loss
        if p == 0:
            return 0
        packets = -(-nbytes // PACKET_BYTES)
        return sum(self._rng.random() < p for _ in range(packets))

    def queue_capacity(self, chunk_size: int) -> int:
        """Enough chunks to keep a bandwidth-delay product in flight (twice: a loss recovery adds a round
        trip), so that latency never caps throughput."""
        in_flight = self.spec.bytes_per_s * 2 * self.spec.latency_s
        if math.isinf(in_flight) or math.isnan(in_flight):
            return MAX_QUEUE
        return min(MAX_QUEUE, MIN_QUEUE + math.ceil(in_flight / chunk_size))


class ShapedStream:
    """A Stream whose outgoing bytes are paced and delayed by a `_Link`; incoming bytes pass through."""

    def __init__(self, inner: Stream, link: _Link, chunk_size: int) -> None:
        self._inner = inner
        self._link = link
        self._chunk_size = chunk_size
        capacity = link.queue_capacity(chunk_size)
        self._to_deliver, self._queued = trio.open_memory_channel[tuple[float, bytes]](capacity)
        self._state: Literal["open", "closed", "reset"] = "open"  # our side's view
        self._fin = False  # we closed (perhaps before a reset): the remote gets EOF after the data
        self._failure: StreamClosed | None = None  # why delivery stopped, if it failed
        self._last_arrival = -math.inf  # when the last queued chunk reaches the remote
        self._reset_at = math.inf  # when our reset reaches the remote
        self._pending = 0  # chunks queued or being delivered
        self._idle = trio.Event()
        self._idle.set()
        self._delivery_scope = trio.CancelScope()
        self._send_scope: trio.CancelScope | None = None  # around a delivery that may block on the remote
        self._read_scopes: set[trio.CancelScope] = set()
        self._finished = trio.Event()  # the delivery task has ended

    @property
    def remote_peer(self) -> NodeId:
        return self._inner.remote_peer

    @property
    def protocol_id(self) -> ProtocolId:
        return self._inner.protocol_id

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        if self._state == "reset":
            await trio.lowlevel.checkpoint()
            raise StreamReset("stream was reset")
        # Our reset is immediate for us even though the inner stream is reset only when the RST arrives, so
        # a reader blocked in the inner stream is woken by cancelling its scope.
        with trio.CancelScope() as scope:
            self._read_scopes.add(scope)
            try:
                return await self._inner.receive_some(max_bytes)
            finally:
                self._read_scopes.discard(scope)
        raise StreamReset("stream was reset")

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        self._check_writable()
        view = memoryview(data).cast("B")
        if not view.nbytes:
            await trio.lowlevel.checkpoint()
            return
        for offset in range(0, view.nbytes, self._chunk_size):
            # A copy: the caller may reuse its buffer as soon as send_all returns.
            chunk = bytes(view[offset:offset + self._chunk_size])
            start, arrive = self._link.reserve(len(chunk), trio.current_time())
            # The writer waits for its chunk's turn on the link, not for its end: the next chunk is booked
            # while this one is on the wire, so scheduling jitter does not add up into lost bandwidth.
            await trio.sleep_until(start)
            self._check_writable()
            await self._enqueue(arrive, chunk)

    async def _enqueue(self, arrive: float, chunk: bytes) -> None:
        if self._pending == 0:
            self._idle = trio.Event()
        self._pending += 1
        try:
            await self._to_deliver.send((arrive, chunk))
        except BaseException as exc:
            self._chunk_done()
            if isinstance(exc, trio.ClosedResourceError | trio.BrokenResourceError):
                self._check_writable()
                raise StreamReset("stream was reset") from None
            raise
        self._last_arrival = max(self._last_arrival, arrive)

    def _chunk_done(self) -> None:
        # The delivery task zeroes the count when it ends, so a late writer must not take it negative.
        self._pending = max(0, self._pending - 1)
        if self._pending == 0:
            self._idle.set()

    def _check_writable(self) -> None:
        if self._state == "reset":
            raise StreamReset("stream was reset")
        if self._state == "closed":
            raise StreamClosed("write after close")
        if self._failure is not None:
            raise StreamReset(f"stream was reset: {self._failure}")

    async def close(self) -> None:
        if self._state == "open":
            self._state = "closed"
            self._fin = True
            # The delivery task drains what is queued, then closes the inner stream.
            self._to_deliver.close()
        await trio.lowlevel.checkpoint()

    async def reset(self) -> None:
        """Reset now for us; the remote sees the bytes already on the wire, then the reset, one latency on
        (a writer still waiting for its turn on the link loses its data)."""
        if self._state == "reset":
            await trio.lowlevel.checkpoint()
            return
        self._state = "reset"
        self._to_deliver.close()
        self._wake_readers()
        if self._finished.is_set():  # closed and delivered, or failed: nothing left to order behind
            await self._inner.reset()
            return
        self._reset_at = max(trio.current_time() + self._link.spec.latency_s, self._last_arrival)
        if self._send_scope is not None:
            self._send_scope.deadline = self._reset_at + STUCK_GRACE_S
        await trio.lowlevel.checkpoint()

    def drop(self) -> None:
        """Stop at once: discard undelivered data without touching the inner stream (its owner resets it)."""
        self._state = "reset"
        self._to_deliver.close()
        self._wake_readers()
        self._delivery_scope.cancel()

    def _wake_readers(self) -> None:
        for scope in self._read_scopes:
            scope.cancel()

    async def flush(self) -> None:
        """Wait until everything sent so far, and a close or reset, has reached the inner stream."""
        if self._state == "open":
            await self._idle.wait()
        else:
            await self._finished.wait()

    async def deliver(self) -> None:
        """The delivery task: release each chunk to the inner stream at its arrival time, in order."""
        try:
            with self._delivery_scope:
                stuck = False
                async for arrive, chunk in self._queued:
                    asked = arrive - _lateness.current()
                    if asked > trio.current_time():
                        await trio.sleep_until(asked)
                        _lateness.observe(asked, trio.current_time())
                    with trio.CancelScope(deadline=self._reset_at + STUCK_GRACE_S) as scope:
                        self._send_scope = scope
                        await self._inner.send_all(chunk)
                    self._send_scope = None
                    if scope.cancelled_caught:
                        stuck = True
                        break
                    self._chunk_done()
                if self._fin and not stuck:
                    # Before a reset too: some stacks (py-libp2p's yamux) keep data that precedes a FIN
                    # readable after a reset, and a peer may rely on that for a last error reply.
                    await self._inner.close()
                if self._state == "reset":
                    await trio.sleep_until(self._reset_at)
                    await self._inner.reset()
        except StreamClosed as exc:
            self._failure = exc
        except Exception as exc:  # an inner transport's own error type: the stream is unusable all the same
            log.debug("delivery to %s failed", self.remote_peer, exc_info=True)
            self._failure = StreamReset(str(exc))
        finally:
            self._queued.close()
            self._pending = 0
            self._idle.set()
            self._finished.set()


class ShapedTransport:
    """A Transport whose streams are ShapedStreams (see the module docstring for the model)."""

    def __init__(self, inner: Transport, link_for: LinkFor, nursery: trio.Nursery, *, seed: int,
                 chunk_size: int, open_rtts: int) -> None:
        self._inner = inner
        self._link_for = link_for
        self._nursery = nursery
        self._seed = seed
        self._chunk_size = chunk_size
        self._open_rtts = open_rtts
        self._links: dict[NodeId, _Link | None] = {}
        self.streams: set[ShapedStream] = set()

    @property
    def peer_id(self) -> NodeId:
        return self._inner.peer_id

    def listen_addrs(self) -> list[str]:
        return self._inner.listen_addrs()

    def set_handler(self, protocol_id: ProtocolId, handler: Handler) -> None:
        async def shaped_handler(stream: Stream) -> None:
            await self._serve(handler, stream)

        self._inner.set_handler(protocol_id, shaped_handler)

    async def connect(self, addr: str) -> NodeId:
        return await self._inner.connect(addr)

    def add_peer_addrs(self, peer: NodeId, addrs: list[str]) -> None:
        self._inner.add_peer_addrs(peer, addrs)

    async def open_stream(self, peer: NodeId, protocol_id: ProtocolId) -> Stream:
        link = self._link(peer)
        if link is not None and self._open_rtts:
            await trio.sleep(self._open_rtts * 2 * link.spec.latency_s)
        return self._wrap(await self._inner.open_stream(peer, protocol_id), link)

    async def disconnect(self, peer: NodeId) -> None:
        for stream in [s for s in self.streams if s.remote_peer == peer]:
            stream.drop()
        await self._inner.disconnect(peer)

    def _link(self, peer: NodeId) -> _Link | None:
        if peer not in self._links:
            spec = self._link_for(self.peer_id, peer)
            if spec is None or spec.unlimited:
                self._links[peer] = None
            else:
                # Seeded by the link's ends, so draws do not depend on which links were used first.
                rng = random.Random(f"{self._seed}/{self.peer_id}/{peer}")
                self._links[peer] = _Link(spec, rng)
        return self._links[peer]

    def _wrap(self, inner: Stream, link: _Link | None) -> Stream:
        if link is None:
            return inner
        stream = ShapedStream(inner, link, self._chunk_size)
        self.streams.add(stream)
        self._nursery.start_soon(self._run_delivery, stream)
        return stream

    async def _run_delivery(self, stream: ShapedStream) -> None:
        try:
            await stream.deliver()
        finally:
            self.streams.discard(stream)

    async def _serve(self, handler: Handler, inner: Stream) -> None:
        stream = self._wrap(inner, self._link(inner.remote_peer))
        if not isinstance(stream, ShapedStream):
            await handler(stream)
            return
        try:
            # Guarded here rather than by the inner transport, so that a failing handler's reset travels
            # behind the data it had already put on the wire, as it would on a real link.
            await run_guarded(handler, stream)
        except BaseException:
            stream.drop()  # cancelled: the daemon is shutting down and the inner transport resets
            raise
        # The inner transport may end the stream's lifetime when the handler returns.
        await stream.flush()


@asynccontextmanager
async def shaped_transport(inner: Transport, link_for: LinkFor, *, seed: int = 0,
                           chunk_size: int = CHUNK_SIZE, open_rtts: int = 2) -> AsyncIterator[ShapedTransport]:
    """Wrap `inner` so that every stream to a remote peer behaves like `link_for(local, remote)`."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, not {chunk_size}")
    async with trio.open_nursery() as nursery:
        shaped = ShapedTransport(inner, link_for, nursery, seed=seed, chunk_size=chunk_size,
                                 open_rtts=open_rtts)
        try:
            yield shaped
        finally:
            # Undelivered data dies with the emulated network; the streams themselves belong to inner.
            for stream in list(shaped.streams):
                stream.drop()
            nursery.cancel_scope.cancel()
