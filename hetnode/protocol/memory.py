"""An in-process transport for fast, deterministic tests (it runs under trio's MockClock).

Peers live in a `MemoryNetwork`; their addresses are `/memory/<name>/p2p/<name>`. Streams are pairs of
bounded byte pipes, so a slow reader pushes back on its writer as a real connection would.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from hetnode.errors import ConfigError, PeerUnreachable, StreamClosed, StreamReset
from hetnode.ids import NodeId, ProtocolId
from hetnode.protocol.transport import Handler, Stream, run_guarded

log = logging.getLogger(__name__)

PIPE_CAPACITY = 1 << 20


class _Pipe:
    """One direction of a stream: a bounded byte buffer with EOF and reset."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.eof = False
        self.reset = False
        self._changed = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        while view.nbytes:
            if self.reset:
                raise StreamReset("stream was reset")
            if self.eof:
                raise StreamClosed("write after close")
            room = PIPE_CAPACITY - len(self.buf)
            if room <= 0:
                await self._changed.wait()
                continue
            self.buf += view[:room]
            view = view[room:]
            self._notify()
        await trio.lowlevel.checkpoint()

    async def read(self, max_bytes: int) -> bytes:
        while True:
            if self.reset:
                raise StreamReset("stream was reset")
            if self.buf:
                out = bytes(self.buf[:max_bytes])
                del self.buf[:max_bytes]
                self._notify()
                await trio.lowlevel.checkpoint()
                return out
            if self.eof:
                await trio.lowlevel.checkpoint()
                return b""
            await self._changed.wait()

    def close(self) -> None:
        self.eof = True
        self._notify()

    def abort(self) -> None:
        self.reset = True
        self._notify()


class MemoryStream:
    def __init__(self, local: NodeId, remote: NodeId, protocol_id: ProtocolId,
                 inbound: _Pipe, outbound: _Pipe) -> None:
        self._local = local
        self._remote = remote
        self._protocol_id = protocol_id
        self._in = inbound
        self._out = outbound
        self._owner: MemoryTransport | None = None

    @property
    def remote_peer(self) -> NodeId:
        return self._remote

    @property
    def protocol_id(self) -> ProtocolId:
        return self._protocol_id

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        return await self._in.read(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._out.write(data)

    async def close(self) -> None:
        if not self._out.reset:
            self._out.close()
        await trio.lowlevel.checkpoint()

    async def reset(self) -> None:
        self._in.abort()
        self._out.abort()
        if self._owner is not None:
            self._owner.streams.discard(self)
        await trio.lowlevel.checkpoint()

    def touches(self, a: NodeId, b: NodeId) -> bool:
        return {self._local, self._remote} == {a, b}


class MemoryNetwork:
    """A registry of in-memory peers; one per test."""

    def __init__(self) -> None:
        self.peers: dict[NodeId, MemoryTransport] = {}

    @asynccontextmanager
    async def transport(self, name: str) -> AsyncIterator[MemoryTransport]:
        peer = NodeId(name)
        if peer in self.peers:
            raise ValueError(f"peer {name} already exists")
        async with trio.open_nursery() as nursery:
            t = MemoryTransport(self, peer, nursery)
            self.peers[peer] = t
            try:
                yield t
            finally:
                del self.peers[peer]
                for s in list(t.streams):
                    s._in.abort()
                    s._out.abort()
                nursery.cancel_scope.cancel()


class MemoryTransport:
    def __init__(self, network: MemoryNetwork, peer: NodeId, nursery: trio.Nursery) -> None:
        self._network = network
        self._peer = peer
        self._nursery = nursery
        self._handlers: dict[ProtocolId, Handler] = {}
        self.streams: set[MemoryStream] = set()

    @property
    def peer_id(self) -> NodeId:
        return self._peer

    def listen_addrs(self) -> list[str]:
        return [f"/memory/{self._peer}/p2p/{self._peer}"]

    def set_handler(self, protocol_id: ProtocolId, handler: Handler) -> None:
        self._handlers[protocol_id] = handler

    def add_peer_addrs(self, peer: NodeId, addrs: list[str]) -> None:
        pass  # every memory peer is reachable by id

    async def connect(self, addr: str) -> NodeId:
        parts = addr.strip("/").split("/")
        if len(parts) != 4 or parts[0] != "memory" or parts[2] != "p2p" or parts[1] != parts[3]:
            raise ConfigError(f"not a memory address: {addr!r} (expected /memory/NAME/p2p/NAME)")
        peer = NodeId(parts[3])
        if peer not in self._network.peers:
            raise PeerUnreachable(f"no memory peer {peer}")
        await trio.lowlevel.checkpoint()
        return peer

    async def open_stream(self, peer: NodeId, protocol_id: ProtocolId) -> Stream:
        await trio.lowlevel.checkpoint()
        remote = self._network.peers.get(peer)
        if remote is None:
            raise PeerUnreachable(f"no memory peer {peer}")
        handler = remote._handlers.get(protocol_id)
        if handler is None:
            raise PeerUnreachable(f"peer {peer} does not serve {protocol_id}")
        a_to_b, b_to_a = _Pipe(), _Pipe()
        mine = MemoryStream(self._peer, peer, protocol_id, b_to_a, a_to_b)
        theirs = MemoryStream(peer, self._peer, protocol_id, a_to_b, b_to_a)
        self.streams.add(mine)
        remote.streams.add(theirs)
        mine._owner, theirs._owner = self, remote
        remote._nursery.start_soon(remote._serve, handler, theirs)
        return mine

    async def _serve(self, handler: Handler, stream: MemoryStream) -> None:
        try:
            await run_guarded(handler, stream)
            # A handler that returns is done writing, as on libp2p: the remote reads the end of the stream.
            await stream.close()
        finally:
            self.streams.discard(stream)

    async def disconnect(self, peer: NodeId) -> None:
        for t in (self, self._network.peers.get(peer)):
            if t is None:
                continue
            for s in list(t.streams):
                if s.touches(self._peer, peer):
                    await s.reset()
                    t.streams.discard(s)
        await trio.lowlevel.checkpoint()
