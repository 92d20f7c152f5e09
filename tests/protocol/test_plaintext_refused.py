"""Our libp2p transport speaks Noise + yamux only: peers that offer only plaintext (or only mplex) get nowhere.

py-libp2p's `new_host()` accepts plaintext unless told otherwise, so this is checked against real py-libp2p
hosts built directly with its API. A control host that offers plaintext *and* Noise does connect, which shows
that the refusals below come from the security and muxer choice and not from a broken test setup.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import multiaddr
import pytest
import trio
from libp2p import new_host
from libp2p.abc import IHost, ISecureTransport
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.crypto.x25519 import create_new_key_pair as create_new_x25519_key_pair
from libp2p.custom_types import TMuxerOptions, TProtocol
from libp2p.network.config import RetryConfig
from libp2p.network.exceptions import SwarmException
from libp2p.network.swarm import Swarm
from libp2p.peer.id import ID
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.mplex.mplex import MPLEX_PROTOCOL_ID, Mplex
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux
from libp2p.transport.tcp.tcp import TCP

from hetnode.errors import PeerUnreachable
from hetnode.ids import NodeId, ProtocolId
from hetnode.protocol.identity import load_or_create_identity
from hetnode.protocol.libp2p_transport import Libp2pTransport, open_libp2p_transport
from hetnode.protocol.transport import Stream

ECHO = ProtocolId("/test/echo/1")
TIMEOUT_S = 15
YAMUX_ONLY: TMuxerOptions = {TProtocol(YAMUX_PROTOCOL_ID): Yamux}


async def echo(stream: Stream) -> None:
    while data := await stream.receive_some():
        await stream.send_all(data)
    await stream.close()


async def echo_libp2p(stream: object) -> None:
    s = stream  # a py-libp2p INetStream
    await s.write(await s.read(1024))  # type: ignore[attr-defined]
    await s.close()  # type: ignore[attr-defined]


@asynccontextmanager
async def foreign_host(security: str, muxer: TMuxerOptions = YAMUX_ONLY) -> AsyncIterator[IHost]:
    """A py-libp2p host with the given security ("plaintext", "noise" or "plaintext+noise")."""
    kp = create_new_key_pair()
    sec: dict[TProtocol, ISecureTransport] = {}
    if "plaintext" in security:
        sec[TProtocol(PLAINTEXT_PROTOCOL_ID)] = InsecureTransport(kp)
    if "noise" in security:
        sec[NOISE_PROTOCOL_ID] = NoiseTransport(kp, noise_privkey=create_new_x25519_key_pair().private_key)
    host = new_host(key_pair=kp, sec_opt=sec, muxer_opt=muxer, transports=[TCP()])
    # One attempt per dial: the default retries only make a refused handshake slower to report.
    swarm = host.get_network()
    assert isinstance(swarm, Swarm)
    swarm.retry_config = RetryConfig(max_retries=0)
    host.set_stream_handler(TProtocol(ECHO), echo_libp2p)
    async with host.run(listen_addrs=[multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/0")]):
        try:
            yield host
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(5):
                await host.close()


@asynccontextmanager
async def our_transport() -> AsyncIterator[Libp2pTransport]:
    async with open_libp2p_transport(load_or_create_identity(None), ["/ip4/127.0.0.1/tcp/0"]) as t:
        t.set_handler(ECHO, echo)
        yield t


def describe(exc: BaseException) -> str:
    """The exception and its causes, where py-libp2p puts the actual reason."""
    parts: list[str] = []
    cur: BaseException | None = exc
    while cur is not None and len(parts) < 6:
        parts.append(f"{type(cur).__name__}: {cur}")
        cur = cur.__cause__ or cur.__context__
    return " <- ".join(parts)


def addr_of(host: IHost) -> str:
    return f"{host.get_transport_addrs()[0]}/p2p/{host.get_id().to_base58()}"


async def foreign_dials_ours(host: IHost, t: Libp2pTransport) -> None:
    """Dial our transport from the foreign host and echo a message over a new stream."""
    peer = ID.from_base58(t.peer_id)
    maddr = multiaddr.Multiaddr(t.listen_addrs()[0]).decapsulate(multiaddr.Multiaddr(f"/p2p/{t.peer_id}"))
    host.get_peerstore().add_addrs(peer, [maddr], 0)
    swarm = host.get_network()
    assert isinstance(swarm, Swarm)
    await swarm.dial_addr(maddr, peer)
    stream = await host.new_stream(peer, [TProtocol(ECHO)])
    await stream.write(b"hi")
    assert await stream.read(1024) == b"hi"
    await stream.close()


def test_our_host_offers_only_noise_and_yamux() -> None:
    # Checked on the configuration, so that a new py-libp2p default cannot add an option unnoticed.
    from hetnode.protocol.libp2p_transport import _new_host

    host = _new_host(load_or_create_identity(None))
    swarm = host.get_network()
    assert isinstance(swarm, Swarm)
    assert list(swarm.upgrader.security_multistream.transports) == [NOISE_PROTOCOL_ID]
    assert list(swarm.upgrader.muxer_multistream.transports) == [YAMUX_PROTOCOL_ID]
    assert [type(t).__name__ for t in swarm.transport_manager.get_transports()] == ["TCP"]


async def test_control_a_host_that_also_offers_noise_connects_both_ways() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with our_transport() as t, foreign_host("plaintext+noise") as host:
            await foreign_dials_ours(host, t)
            await t.disconnect(NodeId(host.get_id().to_base58()))
            peer = await t.connect(addr_of(host))
            stream = await t.open_stream(peer, ECHO)
            await stream.send_all(b"hello")
            assert await stream.receive_some() == b"hello"


REFUSED_SETUPS = pytest.mark.parametrize(("security", "muxer", "offered", "ours"), [
    ("plaintext", YAMUX_ONLY, PLAINTEXT_PROTOCOL_ID, NOISE_PROTOCOL_ID),
    ("noise", {TProtocol(MPLEX_PROTOCOL_ID): Mplex}, MPLEX_PROTOCOL_ID, YAMUX_PROTOCOL_ID),
], ids=["plaintext-only", "mplex-only"])


@REFUSED_SETUPS
async def test_foreign_host_cannot_reach_us(security: str, muxer: TMuxerOptions, offered: str, ours: str) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with our_transport() as t, foreign_host(security, muxer) as host:
            with pytest.raises(SwarmException) as refused:
                await foreign_dials_ours(host, t)
            # TCP connected; we answered "na" to the only protocol the foreign host offered.
            assert f"tried ['{offered}']" in describe(refused.value)
            our_swarm = t.host.get_network()
            assert isinstance(our_swarm, Swarm)
            assert our_swarm.get_connections(host.get_id()) == []
            # A stream needs a connection, which the host cannot get (it dials from its peerstore here).
            with pytest.raises(SwarmException):
                await host.new_stream(ID.from_base58(t.peer_id), [TProtocol(ECHO)])


@REFUSED_SETUPS
async def test_we_cannot_reach_a_foreign_host(security: str, muxer: TMuxerOptions, offered: str, ours: str) -> None:
    with trio.fail_after(TIMEOUT_S):
        async with our_transport() as t, foreign_host(security, muxer) as host:
            with pytest.raises(PeerUnreachable) as refused:
                await t.connect(addr_of(host))
            assert f"tried ['{ours}']" in str(refused.value)  # we offered only Noise / only yamux
            with pytest.raises(PeerUnreachable):
                await t.open_stream(NodeId(host.get_id().to_base58()), ECHO)
