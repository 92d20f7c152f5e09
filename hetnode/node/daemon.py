"""The node daemon: join through a bootstrap peer, keep a control stream to the coordinator, probe links.

Life of a node: dial a bootstrap address, ask it where the coordinator is (/hetnode/discover/1), open the
control stream and join with the admission token and the hardware profile. While admitted it sends heartbeats,
probes every other member's link (when membership changes, and periodically) and reports the results. If the
control stream breaks it rejoins with exponential backoff; a refusal or an exhausted retry budget ends the run.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from hetnode.errors import (
    ConfigError,
    HetnodeError,
    PeerUnreachable,
    ProtocolError,
    Refused,
    StreamClosed,
)
from hetnode.ids import NodeId
from hetnode.node.backoff import backoff_delay
from hetnode.node.hops import HopServer
from hetnode.node.metrics import LinkView, NodeView
from hetnode.protocol.discover import serve_discover
from hetnode.protocol.framing import FramedStream
from hetnode.protocol.messages import (
    CTL_PROTOCOL,
    DISCOVER_PROTOCOL,
    PROBE_PROTOCOL,
    Assignment,
    AssignmentStatus,
    DiscoverReply,
    DiscoverRequest,
    ErrorReply,
    HardwareProfile,
    Heartbeat,
    Join,
    Leave,
    LinkMeasurement,
    LinkReport,
    Load,
    MemberInfo,
    Members,
    ProbeOrder,
    Refuse,
    Welcome,
    ctl_decoder,
    discover_decoder,
)
from hetnode.protocol.probe import ProbeSettings, probe_link, serve_probe
from hetnode.protocol.transport import Stream, Transport

log = logging.getLogger(__name__)
# How long a stream from a peer we do not know yet waits for the membership push that may name it (a hostile
# non-member holds one task that long per stream it opens; the transport bounds its streams).
_MEMBER_WAIT_S = 3.0


@dataclass(frozen=True)
class NodeConfig:
    bootstrap: tuple[str, ...]
    """Multiaddrs (with /p2p/) of any member or of the coordinator itself."""
    token: str
    """Admission token, as given to the coordinator."""
    name: str
    """Human-readable, unique among up members."""
    profile: HardwareProfile
    region: str = ""
    retry_budget_s: float = 3600.0
    """Give up when no bootstrap address has answered for this long (exit 1); 0: never give up. Long, so that
    a coordinator restarted after minutes (an upgrade, a crash) finds its nodes still there."""
    backoff_initial_s: float = 0.25
    backoff_max_s: float = 5.0
    """A restarted coordinator is found within this long of coming back (measured: it then serves its old plan
    again within about a second of the last node's rejoin); a refused dial costs next to nothing, so a short
    cap hammers no one."""
    probe: ProbeSettings = field(default_factory=ProbeSettings)


class NodeDaemon:
    def __init__(self, config: NodeConfig, transport: Transport, hops: HopServer | None = None) -> None:
        if not config.bootstrap:
            raise ConfigError("at least one --bootstrap address is needed")
        self.config = config
        self.transport = transport
        self.hops = hops
        if hops is not None:
            # Sessions are installed only by the coordinator this node joined.
            hops.is_coordinator = lambda peer: peer == self.coordinator
            hops.mailbox.wait_allowed = hops.kv_mailbox.wait_allowed = self.wait_member
            hops.link_mbps = self._link_mbps  # how the KV hand-off to a peer is sent depends on the link
            hops.metrics.view = self._metrics_view
        self.coordinator: NodeId | None = None
        self.coordinator_addrs: list[str] = []
        self.members: dict[NodeId, MemberInfo] = {}
        self.members_version = -1
        self._members_changed = trio.Event()  # set and replaced on every change of `members`
        self.links: dict[NodeId, LinkMeasurement] = {}
        self.assignment: Assignment | None = None
        self.joined = trio.Event()  # set on every successful join; replaced when the session ends
        self.joins = 0
        self._heartbeat_seq = 0
        self._framed: FramedStream | None = None
        self._leaving = False
        self._ctl_ended = trio.Event()  # set when the current control session ends
        self._session_nursery: trio.Nursery | None = None

    # -- membership checks for our own handlers ----------------------------------------------------------

    def is_member(self, peer: NodeId) -> bool:
        return peer == self.coordinator or peer in self.members

    def _metrics_view(self) -> NodeView:
        assert self.hops is not None
        return NodeView(self.hops.load(), {str(p): LinkView(m.bandwidth_mbps, m.rtt_ms) for p, m in self.links.items()},
                        self.assignment.plan_version if self.assignment is not None else None,
                        {**{str(p): m.name for p, m in self.members.items()},
                         **({str(self.coordinator): "coordinator"} if self.coordinator is not None else {})})

    def _link_mbps(self, peer: NodeId) -> float | None:
        m = self.links.get(peer)
        return m.bandwidth_mbps if m is not None and m.bandwidth_mbps > 0 else None

    async def wait_member(self, peer: NodeId) -> bool:
        """Whether `peer` becomes a member within `_MEMBER_WAIT_S`: a node that has just joined may open a
        stream to us before the coordinator's push that names it reaches us."""
        with trio.move_on_after(_MEMBER_WAIT_S):
            while not self.is_member(peer):
                await self._members_changed.wait()
            return True
        return False

    async def _handle_probe(self, stream: Stream) -> None:
        await serve_probe(stream, self.is_member)

    async def _handle_discover(self, stream: Stream) -> None:
        await serve_discover(stream, lambda: None if self.coordinator is None else DiscoverReply(
            coordinator=self.coordinator, addrs=self.coordinator_addrs))

    # -- main loop ---------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Join and stay joined until cancelled or `leave()`. `task_status.started()` fires after the first welcome.

        Raises Refused when the coordinator refuses us and PeerUnreachable when the retry budget runs out."""
        self.transport.set_handler(PROBE_PROTOCOL, self._handle_probe)
        self.transport.set_handler(DISCOVER_PROTOCOL, self._handle_discover)
        attempt = 0  # failed joins in a row
        failing_since = trio.current_time()
        started = False
        while True:
            try:
                framed, welcome = await self._join()
            except (PeerUnreachable, StreamClosed, ProtocolError, OSError) as exc:
                waited = trio.current_time() - failing_since
                budget = self.config.retry_budget_s
                if budget and waited >= budget:
                    raise PeerUnreachable(
                        f"could not join through {', '.join(self.config.bootstrap)} "
                        f"for {waited:.0f} s (last error: {exc})") from exc
                delay = backoff_delay(attempt, initial_s=self.config.backoff_initial_s,
                                      max_s=self.config.backoff_max_s, u=random.random())
                if budget:
                    delay = min(delay, budget - waited)
                log.warning("join failed (%s); retrying in %.1f s", exc, delay)
                await trio.sleep(delay)
                attempt += 1
                continue
            attempt = 0
            self.joins += 1
            if self.hops is not None and self.joins > 1:
                # While we were out, peers rejected our data streams, and a rejecting peer drains what arrives
                # for a while before it resets: data sent on them now would vanish without an error.
                await self.hops.mailbox.forget_all()
            self.joined.set()
            if not started:
                started = True
                task_status.started()
            try:
                await self._session(framed, welcome)
            finally:
                self.joined = trio.Event()
            if self._leaving:
                return
            log.warning("control stream to the coordinator ended; rejoining")
            failing_since = trio.current_time()

    async def _discover(self) -> tuple[NodeId, list[str]]:
        last: Exception | None = None
        for addr in self.config.bootstrap:
            try:
                peer = await self.transport.connect(addr)
                stream = await self.transport.open_stream(peer, DISCOVER_PROTOCOL)
                framed = FramedStream(stream)
                await framed.send_msg(DiscoverRequest())
                reply = await framed.expect_msg(discover_decoder)
                if isinstance(reply, ErrorReply):
                    raise PeerUnreachable(f"{addr} does not know the coordinator: {reply.message}")
                if not isinstance(reply, DiscoverReply):
                    raise ProtocolError(f"unexpected {type(reply).__name__} from {addr}")
                return NodeId(reply.coordinator), list(reply.addrs)
            except ConfigError:
                raise
            except (HetnodeError, OSError) as exc:
                last = exc
        raise PeerUnreachable(str(last) if last else "no bootstrap address")

    async def _join(self) -> tuple[FramedStream, Welcome]:
        coordinator, addrs = await self._discover()
        self.coordinator, self.coordinator_addrs = coordinator, addrs
        self.transport.add_peer_addrs(coordinator, addrs)
        stream = await self.transport.open_stream(coordinator, CTL_PROTOCOL)
        framed = FramedStream(stream)
        await framed.send_msg(Join(
            token=self.config.token, name=self.config.name, region=self.config.region,
            profile=self.config.profile, listen_addrs=self.transport.listen_addrs(),
            software="hetnode/0.1"))
        reply = await framed.expect_msg(ctl_decoder)
        if isinstance(reply, Refuse):
            raise Refused(reply.reason)
        if isinstance(reply, ErrorReply):
            raise ProtocolError(f"coordinator answered join with {reply.code}: {reply.message}")
        if not isinstance(reply, Welcome):
            raise ProtocolError(f"coordinator answered join with {type(reply).__name__}")
        log.info("joined as %s; %d members", self.config.name, len(reply.members))
        self._set_members(-1, reply.members)
        return framed, reply

    def _set_members(self, version: int, members: list[MemberInfo]) -> None:
        me = self.transport.peer_id
        self.members = {NodeId(m.peer_id): m for m in members if m.peer_id != me}
        self.members_version = version
        self._members_changed.set()
        self._members_changed = trio.Event()
        for m in self.members.values():
            self.transport.add_peer_addrs(NodeId(m.peer_id), list(m.addrs))

    async def _session(self, framed: FramedStream, welcome: Welcome) -> None:
        """Serve one membership until the control stream ends or fails."""
        self._framed = framed
        self._ctl_ended = trio.Event()
        try:
            async with trio.open_nursery() as nursery:

                async def until_failure(fn: Callable[[FramedStream, float], Awaitable[None]],
                                        arg: float) -> None:
                    # Errors end the session here rather than escaping as an exception group.
                    try:
                        await fn(framed, arg)
                    except (StreamClosed, ProtocolError, OSError) as exc:
                        log.warning("control session failed: %s", exc)
                    nursery.cancel_scope.cancel()

                self._session_nursery = nursery
                nursery.start_soon(until_failure, self._heartbeats, welcome.heartbeat_interval_s)
                nursery.start_soon(until_failure, self._read_ctl, 0.0)
        finally:
            self._framed = None
            self._ctl_ended.set()
            self._session_nursery = None

    async def leave(self, reason: str = "shutting down", drain_s: float = 0.0) -> None:
        """Tell the coordinator we are going, so that it need not wait for a heartbeat deadline.

        With `drain_s` > 0 and sessions running here, first give the coordinator up to that long to move them to
        other nodes with their KV (this node keeps serving them meanwhile and is routed nothing new), and wait
        until their KV has left."""
        self._leaving = True
        framed = self._framed
        if framed is None:
            return
        if drain_s > 0 and self.hops.sessions:
            began = trio.current_time()
            try:
                await framed.send_msg(Leave(reason=reason, drain_s=drain_s))
                log.info("draining: %d sessions move to other nodes with their KV", len(self.hops.sessions))
                moved = await self.hops.drain(drain_s)
                sent = await self.hops.kv_outbox.flush(max(0.0, drain_s - (trio.current_time() - began)))
                log.info("drained in %.2f s%s", trio.current_time() - began,
                         "" if moved and sent else f" (gave up: {len(self.hops.sessions)} sessions left)")
            except (HetnodeError, OSError) as exc:
                log.info("could not drain through the coordinator: %s", exc)
        with trio.move_on_after(2 if drain_s <= 0 else 12):
            try:
                await framed.send_msg(Leave(reason=reason))
                if drain_s > 0:
                    # The coordinator closes the stream once the KV this node sent has reached its sessions (it
                    # keeps this node a member until then, so the receivers accept it).
                    await self._ctl_ended.wait()
                await framed.aclose()
                log.info("left the cluster: %s", reason)
            except (HetnodeError, OSError) as exc:
                log.info("could not say goodbye to the coordinator: %s", exc)

    async def _read_ctl(self, framed: FramedStream, _unused: float) -> None:
        while True:
            try:
                msg = await framed.receive_msg(ctl_decoder)
            except ProtocolError as exc:
                await framed.reject("bad_message", str(exc))
                return
            if msg is None:
                return
            if isinstance(msg, Members):
                if msg.version > self.members_version:
                    self._set_members(msg.version, msg.members)
            elif isinstance(msg, Assignment):
                self.assignment = msg
                if self.hops is not None:
                    self.hops.start_assign(msg, self._report_assignment)
            elif isinstance(msg, ProbeOrder):
                if self._session_nursery is not None:
                    self._session_nursery.start_soon(self._run_probe_order, framed, msg)
            elif isinstance(msg, ErrorReply):
                log.warning("coordinator: %s: %s", msg.code, msg.message)
                return
            else:
                await framed.reject("bad_message", f"unexpected {type(msg).__name__} from the coordinator")
                return

    def load(self) -> Load:
        return self.hops.load() if self.hops is not None else Load()

    async def _report_assignment(self, status: AssignmentStatus) -> None:
        framed = self._framed
        if framed is None:
            return  # the session ended; the next join gets a fresh assignment
        try:
            await framed.send_msg(status)
            if status.state == "ready":
                # The new shard's KV pool at once, rather than at the next heartbeat: until then the coordinator
                # routes by its planner's estimate of the pool.
                await self._heartbeat(framed)
        except (StreamClosed, OSError) as exc:
            log.info("could not report assignment status: %s", exc)

    async def _heartbeats(self, framed: FramedStream, interval: float) -> None:
        while True:
            await self._heartbeat(framed)
            await trio.sleep(interval)

    async def _heartbeat(self, framed: FramedStream) -> None:
        self._heartbeat_seq += 1
        reports = self.hops.take_reports() if self.hops is not None else []
        await framed.send_msg(Heartbeat(seq=self._heartbeat_seq, load=self.load(), hops=reports))

    async def _run_probe_order(self, framed: FramedStream, order: ProbeOrder) -> None:
        """Measure the ordered links one after another (concurrent probes would measure each other)."""
        results: list[LinkMeasurement] = []
        failed: list[str] = []
        for target in order.targets:
            peer = NodeId(target)
            if peer == self.transport.peer_id or not self.is_member(peer):
                failed.append(target)
                continue
            try:
                results.append(await probe_link(self.transport, peer, self.config.probe))
            except (HetnodeError, OSError, trio.TooSlowError) as exc:
                log.info("probe of %s failed: %s", self._peer_name(peer), exc)
                failed.append(target)
        for m in results:
            self.links[NodeId(m.dst)] = m
        try:
            await framed.send_msg(LinkReport(order=order.order, links=results, failed=failed))
        except (StreamClosed, OSError) as exc:
            # The session is ending; its reader notices and the node rejoins. Nothing to report to.
            log.info("could not report links: %s", exc)
            return
        if results:
            log.info("measured %s", ", ".join(
                f"{self._peer_name(NodeId(m.dst))} {m.bandwidth_mbps:.0f} Mbit/s {m.rtt_ms:.2f} ms"
                for m in results))

    def _peer_name(self, peer: NodeId) -> str:
        if peer == self.coordinator:
            return "coordinator"
        m = self.members.get(peer)
        return m.name if m else str(peer)[:12]

