"""The transport interface: open a stream to a peer for a protocol id, and serve handlers.

Two implementations pass the same conformance suite (tests/protocol/test_transport_conformance.py):
`hetnode.protocol.libp2p_transport` (TCP + Noise + yamux) and `hetnode.protocol.memory` (in-process,
deterministic). `hetnode.protocol.shaping` wraps either one to emulate wide-area links.

Guarantees every implementation gives:
- A handler runs in its own task. An exception that escapes it is logged and the stream is reset; it never
  reaches the transport (py-libp2p lets such an exception take the whole host down).
- `receive_some` returns b"" at a clean end of stream and raises `StreamReset` after a reset.
- `send_all` after the remote reset raises `StreamReset` (or `StreamClosed` after our own close).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from hetnode.errors import StreamClosed
from hetnode.ids import NodeId, ProtocolId

log = logging.getLogger(__name__)


@runtime_checkable
class Stream(Protocol):
    """One bidirectional byte stream between two peers, for one protocol id."""

    @property
    def remote_peer(self) -> NodeId: ...

    @property
    def protocol_id(self) -> ProtocolId: ...

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        """Up to max_bytes; b"" at a clean end of stream; raises StreamReset after a reset."""
        ...

    async def send_all(self, data: bytes | bytearray | memoryview) -> None: ...

    async def close(self) -> None:
        """Close our write side; the remote reads b"" after the data already sent. Idempotent."""
        ...

    async def reset(self) -> None:
        """Abort both directions; the remote's next read or write raises StreamReset. Idempotent."""
        ...


Handler = Callable[[Stream], Awaitable[None]]


class Transport(Protocol):
    """A peer's view of the network."""

    @property
    def peer_id(self) -> NodeId: ...

    def listen_addrs(self) -> list[str]:
        """Dialable addresses of this peer, each ending in /p2p/<peer id> (multiaddr form)."""
        ...

    def set_handler(self, protocol_id: ProtocolId, handler: Handler) -> None:
        """Serve protocol_id; the transport owns the stream's lifetime (it resets it if the handler raises)."""
        ...

    async def connect(self, addr: str) -> NodeId:
        """Dial a full address (with /p2p/<peer id>) and remember it; returns the peer's id.

        Raises PeerUnreachable if the dial fails and ConfigError if the address is malformed."""
        ...

    def add_peer_addrs(self, peer: NodeId, addrs: list[str]) -> None:
        """Remember where a peer listens, so that open_stream can dial it on demand."""
        ...

    async def open_stream(self, peer: NodeId, protocol_id: ProtocolId) -> Stream:
        """Open a new stream to peer (dialing it first if needed); raises PeerUnreachable."""
        ...

    async def disconnect(self, peer: NodeId) -> None:
        """Close every connection to peer (their streams reset). Idempotent."""
        ...


async def run_guarded(handler: Handler, stream: Stream) -> None:
    """Run a stream handler so that nothing it raises can escape into the transport.

    A cancellation (the daemon shutting down) still propagates after the stream is reset."""
    import trio

    try:
        await handler(stream)
    except trio.Cancelled:
        with trio.CancelScope(shield=True), trio.move_on_after(1):
            await _quiet_reset(stream)
        raise
    except StreamClosed as exc:
        log.debug("handler for %s from %s: stream closed: %s", stream.protocol_id, stream.remote_peer, exc)
        await _quiet_reset(stream)
    except Exception:
        log.exception("handler for %s from %s failed; resetting the stream",
                      stream.protocol_id, stream.remote_peer)
        await _quiet_reset(stream)


async def _quiet_reset(stream: Stream) -> None:
    try:
        await stream.reset()
    except Exception:  # a reset of a dead stream has nothing left to report
        log.debug("reset of %s failed", stream.protocol_id, exc_info=True)
