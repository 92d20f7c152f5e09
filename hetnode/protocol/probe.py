"""The probe protocol: round-trip time and bandwidth of one directed link, measured end to end.

RTT is timed with the trio clock over several Ping/Pong exchanges on one stream (sub-millisecond resolution;
py-libp2p's own ping reports whole milliseconds). Bandwidth is a timed bulk transfer from the prober to the
peer: the peer answers BulkDone after the last byte, so the elapsed time is bytes/bandwidth plus one RTT,
and the RTT is subtracted. The transfer grows until it lasts long enough to be measured, up to a byte cap,
so a probe's cost is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

from hetnode.errors import ProtocolError
from hetnode.ids import NodeId
from hetnode.protocol.framing import FramedStream
from hetnode.protocol.messages import (
    PROBE_PROTOCOL,
    BulkDone,
    BulkStart,
    ErrorReply,
    LinkMeasurement,
    Ping,
    Pong,
    probe_decoder,
)
from hetnode.protocol.transport import Stream, Transport

BULK_CHUNK = 256 << 10


@dataclass(frozen=True)
class ProbeSettings:
    # The minimum of this many round trips: enough that one lands in a quiet moment on a busy host.
    pings: int = 15
    # A transfer shorter than this is dominated by timer and scheduling noise.
    min_transfer_s: float = 0.15
    first_bytes: int = 256 << 10
    max_bytes: int = 16 << 20
    timeout_s: float = 20.0


async def serve_probe(stream: Stream, is_member: Callable[[NodeId], bool]) -> None:
    """Answer pings and absorb bulk transfers, for members only."""
    framed = FramedStream(stream, max_frame=BULK_CHUNK + 64)
    if not is_member(stream.remote_peer):
        await framed.reject("not_member", "probes are served to admitted members only")
        return
    try:
        while True:
            msg = await framed.receive_msg(probe_decoder)
            if msg is None:
                await framed.aclose()
                return
            if isinstance(msg, Ping):
                await framed.send_msg(Pong(seq=msg.seq, pad=msg.pad))
            elif isinstance(msg, BulkStart):
                received = 0
                while received < msg.total_bytes:
                    frame = await framed.receive_frame(limit=msg.chunk_bytes)
                    if frame is None:
                        raise ProtocolError("stream ended inside a bulk transfer")
                    received += len(frame)
                await framed.send_msg(BulkDone(received_bytes=received))
            else:
                raise ProtocolError(f"unexpected {type(msg).__name__} on the probe protocol")
    except ProtocolError as exc:
        await framed.reject("bad_message", str(exc))


async def _expect(framed: FramedStream, kind: type) -> object:
    msg = await framed.expect_msg(probe_decoder)
    if isinstance(msg, ErrorReply):
        raise ProtocolError(f"peer refused the probe: {msg.code}: {msg.message}")
    if not isinstance(msg, kind):
        raise ProtocolError(f"expected {kind.__name__}, got {type(msg).__name__}")
    return msg


async def measure_rtt(framed: FramedStream, pings: int) -> float:
    """Round trip in seconds; the first exchange warms the stream and is not counted."""
    samples = []
    for seq in range(pings + 1):
        t0 = trio.current_time()
        await framed.send_msg(Ping(seq=seq, pad=b"\0" * 48))
        await _expect(framed, Pong)
        if seq:
            samples.append(trio.current_time() - t0)
    # The minimum, as TCP and BBR estimate propagation delay: scheduling noise on a busy host only adds time.
    return min(samples)


async def measure_bandwidth(framed: FramedStream, rtt_s: float, settings: ProbeSettings) -> float:
    """Bits per second from prober to peer."""
    chunk = bytes(BULK_CHUNK)
    nbytes = settings.first_bytes
    while True:
        t0 = trio.current_time()
        await framed.send_msg(BulkStart(total_bytes=nbytes, chunk_bytes=BULK_CHUNK))
        sent = 0
        while sent < nbytes:
            n = min(BULK_CHUNK, nbytes - sent)
            await framed.send_frame(memoryview(chunk)[:n])
            sent += n
        done = await _expect(framed, BulkDone)
        elapsed = trio.current_time() - t0
        assert isinstance(done, BulkDone)
        if done.received_bytes != nbytes:
            raise ProtocolError(f"peer received {done.received_bytes} of {nbytes} probe bytes")
        transfer_s = max(elapsed - rtt_s, 1e-6)
        if transfer_s >= settings.min_transfer_s or nbytes >= settings.max_bytes:
            return nbytes * 8 / transfer_s
        # Aim straight for the target duration rather than doubling, with headroom for noise.
        grow = settings.min_transfer_s * 1.5 / transfer_s
        nbytes = min(settings.max_bytes, max(nbytes * 2, int(nbytes * grow)))


async def probe_link(transport: Transport, peer: NodeId,
                     settings: ProbeSettings = ProbeSettings()) -> LinkMeasurement:
    """Measure the directed link from this peer to `peer`. Raises on failure (bounded by a timeout)."""
    with trio.fail_after(settings.timeout_s):
        stream = await transport.open_stream(peer, PROBE_PROTOCOL)
        framed = FramedStream(stream, max_frame=BULK_CHUNK + 64)
        try:
            rtt = await measure_rtt(framed, settings.pings)
            bps = await measure_bandwidth(framed, rtt, settings)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(1):
                await framed.aclose()
    return LinkMeasurement(dst=peer, bandwidth_mbps=bps / 1e6, rtt_ms=rtt * 1e3, measured_at=time.time())
