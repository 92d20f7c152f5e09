"""The libp2p implementation of the transport interface: TCP + Noise (XX) + yamux, and nothing else.

    async with open_libp2p_transport(load_or_create_identity(path), ["/ip4/0.0.0.0/tcp/4001"]) as t:
        t.set_handler(CTL_PROTOCOL, handle_ctl)
        peer = await t.connect("/ip4/1.2.3.4/tcp/4001/p2p/12D3KooW...")
        stream = await t.open_stream(peer, CTL_PROTOCOL)

py-libp2p 0.8.1 is used through its public host API where that works, but several of its defaults are wrong
for a serving network, and this module works around each one (the tests in tests/protocol pin them):

- `new_host()` offers plaintext, secio and TLS and falls back to mplex unless `sec_opt`/`muxer_opt` are
  given, and it adds QUIC or WebSocket transports when a listen address asks for them. We pass Noise only,
  yamux only and `transports=[TCP()]`, so a peer that offers anything else fails the handshake.
- Its yamux writer gives up with an error after waiting 5 s for the reader to open the flow-control window,
  so a slow consumer kills the stream instead of pushing back. `send_all` only ever writes what fits the
  current window and waits for more itself, with no deadline (see `_wait_for_send_window`).
- Its yamux connection has one reader task, and that task writes too (stream ACKs, ping replies) and
  blocks when the socket is full. If both peers' readers block like that while app tasks on both sides
  fill the sockets, the connection deadlocks: 100 concurrent echo streams on a fresh connection did, about
  one run in five. `_Yamux` queues the reader's frames for a writer task, so the reader never stops reading.
  (py-libp2p ignores the class given in `muxer_opt` for yamux; `_MuxerMultistream` makes it use ours.)
- A reset from the remote often reads as a clean end of stream (yamux drops the stream's record on RST and
  the next read reports EOF), and a local `reset()` does not wake a task blocked in `read()`.
  `receive_some` checks the muxed stream's flags to tell the two apart and `reset()` wakes the reader.
- An outbound stream's resources (a slot of the swarm's stream semaphore) are only given back when the stream
  is reset or closed in both directions through `NetStream.close()`, which is a full close; a half-closed
  stream that was read to EOF leaked its slot. `Libp2pStream` releases them once both directions are done.
- `host.connect()` and dialing from `new_stream()` wait 250 ms after a successful dial (a happy-eyeballs
  delay applied even to the last address), retry failed dials with back-off, then refuse to dial the peer
  for 60 s (a negative cache), and store addresses with a TTL that other subsystems overwrite.
  We keep our own address book and dial through `Swarm.dial_addr` with retries off and our own deadline.
- The swarm's auto-connector dials every peer in the peerstore (identify fills it) until it has 150
  connections, and redials peers we hung up on. It is stopped once the swarm runs: the daemon decides whom
  to talk to. (No ConnectionConfig setting disables it: its target is the midpoint of the watermarks.)
- Its TCP listener sets SO_REUSEPORT, so a second daemon started on a taken port shares it silently;
  `open_libp2p_transport` checks that a fixed listen port is free first.
- Leaving `host.run()` cancels the swarm without closing its connections (sockets leak, with a
  ResourceWarning); we close every connection, concurrently, then the host, under a bounded shielded scope.

What a handler sees: it runs in its own task (py-libp2p's per-connection nursery), wrapped by `run_guarded`.
When it returns normally the transport closes the stream's write side (the remote reads b"" after the
data), so a handler that forgets to close cannot leave the remote waiting.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import cast

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, IMuxedConn, INetStream, ISecureConn
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as _new_x25519_key_pair
from libp2p.custom_types import TMuxerOptions, TProtocol
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.connection.exceptions import RawConnError
from libp2p.network.connection.swarm_connection import SwarmConn
from libp2p.network.stream.exceptions import StreamEOF as _Libp2pEOF
from libp2p.network.stream.net_stream import NetStream
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.muxer_multistream import MuxerMultistream
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream
from libp2p.transport.tcp.tcp import TCP

from hetnode.errors import ConfigError, PeerUnreachable, StreamClosed, StreamReset
from hetnode.ids import NodeId, ProtocolId
from hetnode.protocol.transport import Handler, run_guarded

log = logging.getLogger(__name__)

# A dial covers TCP connect, the Noise handshake and yamux negotiation; a reachable peer takes milliseconds
# on a LAN and well under a second across continents, so 10 s only ends dials that will never succeed.
DIAL_TIMEOUT_S = 10.0
# Closing a connection in py-libp2p sleeps 0.2 s; connections close concurrently, so this bounds the whole
# shutdown even with a peer that no longer answers.
SHUTDOWN_TIMEOUT_S = 5.0
# py-libp2p's yamux has no event for "the peer opened the window", so a writer facing a full window polls.
# It starts fast (an RTT on loopback is tens of microseconds) and backs off to what py-libp2p itself uses.
_WINDOW_POLL_MIN_S = 0.0002
_WINDOW_POLL_MAX_S = 0.01

# What py-libp2p raises from stream reads and writes once a stream or its connection is gone. Its stream
# errors all derive from BaseLibp2pError; the trio errors come through from the socket on some paths.
_STREAM_ERRORS = (BaseLibp2pError, trio.BrokenResourceError, trio.ClosedResourceError, OSError)


# -- addresses ------------------------------------------------------------------------------------------


def parse_multiaddr(addr: str) -> multiaddr.Multiaddr:
    """The multiaddr in addr; ConfigError (saying why) if it is not one."""
    if not isinstance(addr, str) or not addr.startswith("/"):
        raise ConfigError(f"not a multiaddr: {addr!r} (expected e.g. /ip4/10.0.0.1/tcp/4001/p2p/12D3KooW...)")
    try:
        return multiaddr.Multiaddr(addr)
    except Exception as exc:  # the multiaddr package raises several unrelated exception types
        raise ConfigError(f"not a valid multiaddr: {addr!r} ({exc})") from exc


def _split_peer(maddr: multiaddr.Multiaddr, text: str) -> tuple[multiaddr.Multiaddr, ID | None]:
    """(the transport part, the /p2p/ peer id or None)."""
    protocols = [p.name for p in maddr.protocols()]
    if "p2p" not in protocols:
        return maddr, None
    if protocols[-1] != "p2p" or protocols.count("p2p") != 1:
        raise ConfigError(f"{text!r}: /p2p/<peer id> must come last, once (relay addresses are not supported)")
    try:
        peer = ID.from_base58(str(maddr.value_for_protocol("p2p")))
    except Exception as exc:
        raise ConfigError(f"{text!r}: bad peer id ({exc})") from exc
    return maddr.decapsulate(multiaddr.Multiaddr(f"/p2p/{peer.to_base58()}")), peer


def _check_tcp(maddr: multiaddr.Multiaddr, text: str) -> None:
    names = [p.name for p in maddr.protocols()]
    if len(names) != 2 or names[0] not in ("ip4", "ip6", "dns", "dns4", "dns6") or names[1] != "tcp":
        raise ConfigError(f"{text!r}: only TCP addresses are supported (/ip4|ip6|dns/HOST/tcp/PORT)")


def _check_port_free(maddr: multiaddr.Multiaddr, text: str) -> None:
    """ConfigError if something already listens on this fixed port.

    py-libp2p listens with SO_REUSEPORT (for hole punching), so a second daemon on a taken port would
    silently share it with the first, each getting some of the incoming connections. A plain bind (with
    SO_REUSEADDR, so that connections of a previous run in TIME_WAIT do not count) finds the conflict."""
    family_name = next(iter(maddr.protocols())).name
    if family_name not in ("ip4", "ip6"):
        return
    port = int(maddr.value_for_protocol("tcp"))
    if port == 0:
        return
    family = socket.AF_INET if family_name == "ip4" else socket.AF_INET6
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((str(maddr.value_for_protocol(family_name)), port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {text}: {exc.strerror or exc}") from exc


def _node_id(peer: ID) -> NodeId:
    return NodeId(peer.to_base58())


def _peer_from_node_id(peer: NodeId) -> ID:
    try:
        return ID.from_base58(peer)
    except Exception as exc:
        raise PeerUnreachable(f"{peer!r} is not a libp2p peer id") from exc


def _describe(exc: BaseException) -> str:
    """A one-line reason: py-libp2p wraps the interesting error (refused, handshake) a few levels down."""
    parts: list[str] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(parts) < 4:
        seen.add(id(cur))
        text = str(cur).strip() or type(cur).__name__
        if not parts or text not in parts[-1]:
            parts.append(text)
        cur = cur.__cause__ or cur.__context__
    return ": ".join(parts)


# -- the muxer -----------------------------------------------------------------------------------------

# Frames the reader queued but the socket did not take yet; a peer that lets this many pile up (by sending
# pings or opening streams while it reads nothing) is not worth keeping.
_MAX_QUEUED_CONTROL_FRAMES = 4096


class _Yamux(Yamux):
    """py-libp2p's yamux, except that the connection's reader task never blocks on a write.

    `handle_incoming` answers some frames itself (SYN with ACK, ping with pong, RST for a duplicate stream)
    with `_write_frame`, which waits for the socket. Those frames go to a queue drained by a writer task
    instead. A control frame may then leave after data frames written later by other tasks; yamux allows
    that (data on a stream that is not ACKed yet is accepted)."""

    _reader: trio.lowlevel.Task | None = None
    _control: trio.MemorySendChannel[bytes] | None = None

    async def handle_incoming(self) -> None:
        if self._nursery is None:  # start() sets it before running us; without it, keep the old behaviour
            await super().handle_incoming()
            return
        send, receive = trio.open_memory_channel[bytes](_MAX_QUEUED_CONTROL_FRAMES)
        self._control = send
        self._reader = trio.lowlevel.current_task()
        self._nursery.start_soon(self._send_control_frames, receive)
        try:
            await super().handle_incoming()
        finally:
            self._reader = None
            send.close()

    async def _write_frame(self, data: bytes) -> None:
        if self._control is None or trio.lowlevel.current_task() is not self._reader:
            await super()._write_frame(data)
            return
        try:
            self._control.send_nowait(data)
        except trio.WouldBlock:
            # handle_incoming treats RawConnError as a dead connection and closes it.
            raise RawConnError("peer does not read; too many control frames queued") from None
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            raise RawConnError("connection is closing") from None
        await trio.lowlevel.checkpoint()

    async def _send_control_frames(self, receive: trio.MemoryReceiveChannel[bytes]) -> None:
        async with receive:
            async for frame in receive:
                try:
                    await Yamux._write_frame(self, frame)
                except Exception as exc:  # the connection is gone; the reader sees that and cleans up
                    log.debug("yamux control frame to %s not sent: %s", self.peer_id, exc)
                    return


class _MuxerMultistream(MuxerMultistream):
    """Muxer negotiation that builds the muxer class it was configured with.

    py-libp2p's `new_conn` constructs its own `Yamux` whenever /yamux/1.0.0 is negotiated, whatever class
    `muxer_opt` names, so `_Yamux` only takes effect through this."""

    async def new_conn(self, conn: ISecureConn, peer_id: ID) -> IMuxedConn:
        protocol, muxer_class = await self._selector.select(conn, conn.is_initiator, self.negotiate_timeout)
        return self._annotate_connection(muxer_class(conn, peer_id), conn, protocol)


# -- streams --------------------------------------------------------------------------------------------


class Libp2pStream:
    """One yamux stream, with the semantics of `hetnode.protocol.transport.Stream`.

    Finish every stream, as the interface asks anyway: close it and read to EOF, or reset it. An abandoned
    outbound stream keeps a slot of the swarm's stream limit (10000) until its connection closes."""

    def __init__(self, net_stream: INetStream, remote: NodeId, protocol_id: ProtocolId) -> None:
        # Swarm streams are NetStreams; the interface type lacks the half-close and release methods we need.
        self._ns = cast(NetStream, net_stream)
        muxed = self._ns.muxed_stream
        if not isinstance(muxed, YamuxStream):  # only yamux is configured; anything else is a bug here
            raise TypeError(f"expected a yamux stream, got {type(muxed).__name__}")
        self._muxed = muxed
        self._remote = remote
        self._protocol_id = protocol_id
        # One writer at a time, so that the window we checked is still ours when we write.
        self._send_lock = trio.Lock()
        self._write_closed = False
        self._eof = False
        self._reset = False
        self._released = False

    @property
    def remote_peer(self) -> NodeId:
        return self._remote

    @property
    def protocol_id(self) -> ProtocolId:
        return self._protocol_id

    def _remote_gone(self) -> bool:
        """The stream was reset by either side, or its connection went away."""
        return bool(self._muxed.reset_received or self._muxed.conn.event_shutting_down.is_set())

    async def receive_some(self, max_bytes: int = 65536) -> bytes:
        if max_bytes < 1:
            raise ValueError("max_bytes must be at least 1")
        if self._reset or (self._eof and self._remote_gone()):
            # A reset after a clean EOF still counts, as in the memory transport: the stream is gone.
            self._reset = True
            await trio.lowlevel.checkpoint()
            raise StreamReset("stream was reset")
        if self._eof:
            await trio.lowlevel.checkpoint()
            return b""
        try:
            data = await self._ns.read(max_bytes)
        except _Libp2pEOF as exc:
            if self._reset or self._remote_gone():
                self._reset = True
                raise StreamReset("stream was reset") from exc
            self._eof = True
            await self._release_if_done()
            return b""
        except _STREAM_ERRORS as exc:
            self._reset = True
            raise StreamReset(f"stream was reset ({_describe(exc)})") from exc
        if not data:  # py-libp2p signals EOF with an exception; treat an empty read the same way
            self._eof = True
            await self._release_if_done()
        return data

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        async with self._send_lock:
            if self._reset:
                raise StreamReset("stream was reset")
            if self._write_closed:
                raise StreamClosed("write after close")
            if not view.nbytes:
                await trio.lowlevel.checkpoint()
                return
            while view.nbytes:
                window = self._muxed.send_window
                if window <= 0:
                    await self._wait_for_send_window()
                    continue
                n = min(window, view.nbytes)
                try:
                    await self._ns.write(bytes(view[:n]))
                except _STREAM_ERRORS as exc:
                    if self._write_closed:
                        raise StreamClosed("write after close") from exc
                    self._reset = True
                    raise StreamReset(f"stream was reset ({_describe(exc)})") from exc
                view = view[n:]

    async def _wait_for_send_window(self) -> None:
        """Until the remote has read enough to open our send window again, however long that takes.

        Waiting is the backpressure the rest of hetnode relies on (a full node slows its upstream). py-libp2p
        would fail the write after 5 s instead, and offers no event for a window update, hence the poll."""
        delay = _WINDOW_POLL_MIN_S
        while self._muxed.send_window <= 0:
            if self._reset or self._muxed.closed or self._remote_gone():
                self._reset = True
                raise StreamReset("stream was reset while waiting to send")
            if self._write_closed:
                raise StreamClosed("write after close")
            await trio.sleep(delay)
            delay = min(delay * 2, _WINDOW_POLL_MAX_S)

    async def close(self) -> None:
        if self._write_closed or self._reset:
            await trio.lowlevel.checkpoint()
            return
        self._write_closed = True
        try:
            await self._ns.close_write()
        except _STREAM_ERRORS as exc:  # the connection is gone; the remote sees a reset, nothing to add
            log.debug("half-close of %s to %s failed: %s", self._protocol_id, self._remote, exc)
        await self._release_if_done()

    async def reset(self) -> None:
        if self._reset:
            await trio.lowlevel.checkpoint()
            return
        self._reset = True
        conn = self._muxed.conn
        sid = self._muxed.stream_id
        waiter = conn.stream_events.get(sid)
        try:
            # Sends RST and releases the stream's resources. It must run even under cancellation (a reset is
            # how a cancelled handler tells the remote), and it only writes one small frame.
            with trio.CancelScope(shield=True):
                await self._ns.reset()
        except Exception as exc:  # never fail a reset: the stream is dead either way
            log.debug("reset of %s to %s failed: %s", self._protocol_id, self._remote, exc)
        self._released = True
        # yamux drops the stream's event without setting it, which would leave our own blocked reader
        # waiting forever; wake it (it then raises StreamReset), and forget the entry it re-creates.
        if waiter is not None:
            waiter.set()
        await trio.lowlevel.checkpoint()
        if sid not in conn.streams:
            conn.stream_events.pop(sid, None)

    async def _release_if_done(self) -> None:
        """Give the stream's slot back to the swarm once both directions are finished."""
        if self._released or not (self._write_closed and self._eof):
            return
        self._released = True
        try:
            await self._ns.remove()
        except Exception as exc:
            log.debug("release of %s to %s failed: %s", self._protocol_id, self._remote, exc)

    async def _after_handler(self) -> None:
        """The handler returned normally: finish our side cleanly (the remote reads EOF after the data)."""
        await self.close()


# -- the transport --------------------------------------------------------------------------------------


class Libp2pTransport:
    """A peer on the libp2p network. Create it with `open_libp2p_transport`."""

    def __init__(self, host: IHost) -> None:
        self._host = host
        self._swarm = cast(Swarm, host.get_network())
        self._peer_id = _node_id(host.get_id())
        # Where each peer listens, as told by connect()/add_peer_addrs(); the peerstore is not used for
        # this because other subsystems overwrite its per-peer TTL and then expire the addresses.
        self._addr_book: dict[ID, list[multiaddr.Multiaddr]] = {}
        self._dial_locks: dict[ID, trio.Lock] = {}

    @property
    def peer_id(self) -> NodeId:
        return self._peer_id

    @property
    def host(self) -> IHost:
        """The py-libp2p host, for diagnostics; hetnode code talks to the Transport interface only."""
        return self._host

    def listen_addrs(self) -> list[str]:
        # The bound addresses, real port included. A wildcard (0.0.0.0) is not dialable from elsewhere:
        # it is announced as each of this host's IPv4 addresses instead.
        out: list[str] = []
        for a in self._host.get_transport_addrs():
            text = str(a)
            if text.startswith("/ip4/0.0.0.0/"):
                rest = text.removeprefix("/ip4/0.0.0.0")
                out += [f"/ip4/{ip}{rest}/p2p/{self._peer_id}" for ip in _local_ipv4()]
            else:
                out.append(f"{text}/p2p/{self._peer_id}")
        return out

    def set_handler(self, protocol_id: ProtocolId, handler: Handler) -> None:
        async def serve(net_stream: INetStream) -> None:
            await self._serve(handler, protocol_id, net_stream)

        self._host.set_stream_handler(TProtocol(protocol_id), serve)

    async def _serve(self, handler: Handler, protocol_id: ProtocolId, net_stream: INetStream) -> None:
        try:
            stream = Libp2pStream(net_stream, _node_id(net_stream.muxed_conn.peer_id), protocol_id)
        except Exception:  # an exception here would reach py-libp2p, which must never see one
            log.exception("cannot serve a %s stream", protocol_id)
            await net_stream.reset()
            return
        await run_guarded(handler, stream)
        await stream._after_handler()

    # -- peers ------------------------------------------------------------------------------------------

    def add_peer_addrs(self, peer: NodeId, addrs: list[str]) -> None:
        peer_id = _peer_from_node_id(peer)
        book = self._addr_book.setdefault(peer_id, [])
        for text in addrs:
            maddr, embedded = _split_peer(parse_multiaddr(text), text)
            if embedded is not None and embedded != peer_id:
                raise ConfigError(f"{text!r} is an address of {embedded.to_base58()}, not of {peer}")
            _check_tcp(maddr, text)
            if maddr not in book:
                book.append(maddr)

    async def connect(self, addr: str) -> NodeId:
        maddr, peer_id = _split_peer(parse_multiaddr(addr), addr)
        if peer_id is None:
            raise ConfigError(f"{addr!r} has no /p2p/<peer id> at the end; the peer id is needed to "
                              "authenticate the peer")
        _check_tcp(maddr, addr)
        if _node_id(peer_id) == self._peer_id:
            raise ConfigError(f"{addr!r} is this peer's own address")
        book = self._addr_book.setdefault(peer_id, [])
        if maddr in book:
            book.remove(maddr)
        book.insert(0, maddr)  # the address we were just given is the one to try first
        await self._ensure_connected(peer_id)
        return _node_id(peer_id)

    def _connected(self, peer_id: ID) -> bool:
        return any(not c.is_closed for c in self._swarm.get_connections(peer_id))

    async def _ensure_connected(self, peer_id: ID) -> None:
        if self._connected(peer_id):
            await trio.lowlevel.checkpoint()
            return
        lock = self._dial_locks.setdefault(peer_id, trio.Lock())
        async with lock:  # concurrent open_stream calls share one dial
            if self._connected(peer_id):
                return
            addrs = list(self._addr_book.get(peer_id, ()))
            if not addrs:
                raise PeerUnreachable(f"no known address for peer {peer_id.to_base58()}")
            errors = []
            for maddr in addrs:
                try:
                    with trio.fail_after(DIAL_TIMEOUT_S):
                        conn = await self._swarm.dial_addr(maddr, peer_id)
                        if isinstance(conn, SwarmConn):
                            await conn.event_started.wait()
                    return
                except trio.TooSlowError:
                    errors.append(f"{maddr}: no answer within {DIAL_TIMEOUT_S:g} s")
                except Exception as exc:  # py-libp2p wraps refusals, handshake failures, ... in SwarmException
                    errors.append(f"{maddr}: {_describe(exc)}")
            raise PeerUnreachable(f"cannot reach {peer_id.to_base58()}: " + "; ".join(errors))

    async def open_stream(self, peer: NodeId, protocol_id: ProtocolId) -> Libp2pStream:
        peer_id = _peer_from_node_id(peer)
        if peer == self._peer_id:
            raise PeerUnreachable("cannot open a stream to ourselves")
        await self._ensure_connected(peer_id)
        try:
            net_stream = await self._host.new_stream(peer_id, [TProtocol(protocol_id)])
        except Exception as exc:  # StreamFailure (protocol refused), SwarmException (connection gone), ...
            raise PeerUnreachable(f"cannot open {protocol_id} to {peer}: {_describe(exc)}") from exc
        return Libp2pStream(net_stream, peer, protocol_id)

    async def disconnect(self, peer: NodeId) -> None:
        try:
            peer_id = ID.from_base58(peer)
        except Exception:
            await trio.lowlevel.checkpoint()
            return
        # Each closed connection removes itself from the swarm's table; popping the peer's entry here could
        # drop a connection that arrived meanwhile without closing it.
        await self._close_connections(cast(list[SwarmConn], self._swarm.get_connections(peer_id)))

    # -- lifetime ---------------------------------------------------------------------------------------

    async def _close_connections(self, conns: list[SwarmConn]) -> None:
        async def close_one(conn: SwarmConn) -> None:
            try:
                await conn.close()
            except Exception as exc:
                log.debug("closing a connection to %s failed: %s", conn.muxed_conn.peer_id, exc)

        async with trio.open_nursery() as nursery:
            for conn in conns:
                nursery.start_soon(close_one, conn)

    async def _shutdown(self) -> None:
        conns = [c for cs in self._swarm.get_connections_map().values() for c in cs]
        await self._close_connections(cast(list[SwarmConn], conns))
        await self._host.close()


MUXERS: TMuxerOptions = {TProtocol(YAMUX_PROTOCOL_ID): _Yamux}


def _new_host(key_pair: KeyPair) -> IHost:
    # Noise needs its own X25519 static key; it is signed with the identity key during the handshake, so
    # a fresh one per process is what other libp2p implementations do too.
    noise = NoiseTransport(key_pair, noise_privkey=_new_x25519_key_pair().private_key)
    host = new_host(
        key_pair=key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_opt=MUXERS,
        transports=[TCP()],
        # Below min_connections the auto-connector polls every 10 s; with 0 it never counts as "critical".
        connection_config=ConnectionConfig(min_connections=0, low_watermark=0),
    )
    swarm = cast(Swarm, host.get_network())
    swarm.upgrader.muxer_multistream = _MuxerMultistream(MUXERS, swarm.upgrader.muxer_multistream.negotiate_timeout)
    # Dial retries belong to the caller (a node retries its bootstrap with its own back-off); inside the
    # transport they only delay PeerUnreachable by 0.7 s.
    swarm.retry_config = RetryConfig(max_retries=0)
    return host


@asynccontextmanager
async def open_libp2p_transport(key_pair: KeyPair, listen_addrs: list[str]) -> AsyncIterator[Libp2pTransport]:
    """A libp2p peer listening on listen_addrs (TCP multiaddrs; port 0 picks a free port) until the block ends.

    Raises ConfigError for a malformed or non-TCP address, or one that cannot be listened on."""
    maddrs = []
    for text in listen_addrs:
        maddr, peer = _split_peer(parse_multiaddr(text), text)
        if peer is not None:
            raise ConfigError(f"listen address {text!r} must not name a peer id")
        _check_tcp(maddr, text)
        _check_port_free(maddr, text)
        maddrs.append(maddr)
    host = _new_host(key_pair)
    transport = Libp2pTransport(host)
    async with host.run(listen_addrs=maddrs):
        try:
            swarm = cast(Swarm, host.get_network())
            # Swarm.run starts the auto-connector before listening completes; stopping it here is final.
            await swarm.auto_connector.stop()
            listening = swarm.listeners
            failed = [str(m) for m in maddrs if str(m) not in listening]
            if failed:  # py-libp2p logs and carries on when a listen fails; a daemon must not
                raise ConfigError(f"cannot listen on {', '.join(failed)} (address in use or not local?)")
            log.info("libp2p peer %s listening on %s", transport.peer_id, ", ".join(transport.listen_addrs()))
            yield transport
        finally:
            with trio.CancelScope(shield=True) as scope:
                scope.deadline = trio.current_time() + SHUTDOWN_TIMEOUT_S
                await transport._shutdown()
            if scope.cancelled_caught:
                log.warning("libp2p shutdown took over %g s; abandoning open connections", SHUTDOWN_TIMEOUT_S)


__all__ = ["Libp2pStream", "Libp2pTransport", "open_libp2p_transport", "parse_multiaddr"]


def _local_ipv4() -> list[str]:
    """This host's IPv4 addresses, loopback last (peers on other hosts should try a routable one first)."""
    import psutil

    ips = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET]
    return sorted(set(ips), key=lambda ip: (ip.startswith("127."), ip)) or ["127.0.0.1"]
