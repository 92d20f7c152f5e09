"""The coordinator daemon: admits nodes, tracks their liveness and links, and serves the REST API.

Each admitted node keeps one long-lived control stream (/hetnode/ctl/1) open: heartbeats, link reports and
assignment status flow up it, membership updates and assignments flow down. The stream closing, or a
heartbeat deadline passing, marks the node down; a node that comes back is admitted again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from transformers import PreTrainedTokenizerBase

from hetnode.coordinator.deployment import Deployment, PlanningConfig
from hetnode.coordinator.probes import ProbeScheduler
from hetnode.coordinator.registry import Registry
from hetnode.coordinator.sessions import PipelineGenerator
from hetnode.errors import ProtocolError, StreamClosed
from hetnode.ids import NodeId
from hetnode.models.config import ModelConfig
from hetnode.protocol.discover import serve_discover
from hetnode.protocol.framing import FramedStream
from hetnode.protocol.messages import (
    CTL_PROTOCOL,
    DISCOVER_PROTOCOL,
    PROBE_PROTOCOL,
    Assignment,
    AssignmentStatus,
    DiscoverReply,
    ErrorReply,
    Heartbeat,
    Join,
    Leave,
    LinkReport,
    Members,
    ProbeOrder,
    Refuse,
    Welcome,
    ctl_decoder,
)
from hetnode.protocol.probe import ProbeSettings, serve_probe
from hetnode.protocol.transport import Stream, Transport

log = logging.getLogger(__name__)
# How long a node that leaves stays a member while the KV it sent is on its way (then it is gone anyway).
_KV_DELIVERY_S = 10.0
# A control message that cannot go within this is reported unsent (an assignment is tried again later).
_CTL_SEND_S = 5.0


@dataclass(frozen=True)
class CoordinatorConfig:
    token: str
    """Admission token every joining node must present."""
    heartbeat_interval_s: float = 1.0
    """How often nodes send heartbeats (told to them in Welcome)."""
    heartbeat_deadline_s: float = 5.0
    """A node with no heartbeat for this long is marked down."""
    probe_interval_s: float = 60.0
    """How often every link is measured again while membership is stable."""
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    """Cost bounds of one link measurement."""

    def __post_init__(self) -> None:
        if not self.token:
            raise ValueError("the admission token must not be empty")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_deadline_s:
            raise ValueError("need 0 < heartbeat interval < heartbeat deadline")
        if self.probe_interval_s <= 0:
            raise ValueError("probe interval must be positive")


class _Session:
    """One admitted node's control stream."""

    def __init__(self, peer: NodeId, framed: FramedStream) -> None:
        self.peer = peer
        self.framed = framed


class Coordinator:
    def __init__(self, config: CoordinatorConfig, transport: Transport) -> None:
        self.config = config
        self.transport = transport
        self.registry = Registry(token=config.token, heartbeat_deadline_s=config.heartbeat_deadline_s)
        self._sessions: dict[NodeId, _Session] = {}
        self._changed = trio.Event()  # membership or deadlines changed: the liveness watcher re-arms
        self.probes = ProbeScheduler(self.registry, transport, self._send_ctl,
                                     interval_s=config.probe_interval_s, settings=config.probe)
        self.deployment: Deployment | None = None
        self.generator: PipelineGenerator | None = None

    def enable_serving(self, *, model: str, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase,
                       home_region: str = "", ready_timeout_s: float = 30.0,
                       planning: PlanningConfig | None = None) -> PipelineGenerator:
        """Plan layers over the members and serve requests through them (call before run)."""
        self.deployment = Deployment(self.registry, self._send_ctl, model=model, model_config=model_config,
                                     coordinator=self.transport.peer_id, home_region=home_region,
                                     planning=planning)
        self.generator = PipelineGenerator(self.transport, self.registry, self.deployment, model_name=model,
                                           model_config=model_config, tokenizer=tokenizer,
                                           ready_timeout_s=ready_timeout_s)
        return self.generator

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self.transport.set_handler(CTL_PROTOCOL, self._handle_ctl)
            self.transport.set_handler(PROBE_PROTOCOL, self._handle_probe)
            self.transport.set_handler(DISCOVER_PROTOCOL, self._handle_discover)
            nursery.start_soon(self._watch_liveness)
            nursery.start_soon(self.probes.run)
            if self.deployment is not None and self.generator is not None:
                nursery.start_soon(self.deployment.run)
                nursery.start_soon(self.deployment.run_scaling)
                nursery.start_soon(self.deployment.run_resends)
                await nursery.start(self.generator.run)
            task_status.started()

    def _poke(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _watch_liveness(self) -> None:
        """Sleep until the earliest heartbeat deadline (or a change), then mark the late nodes down."""
        while True:
            deadline = self.registry.next_deadline()
            changed = self._changed
            with trio.move_on_at(deadline if deadline is not None else float("inf")):
                await changed.wait()
            expired = self.registry.expire(now=trio.current_time())
            for peer in expired:
                log.warning("node %s marked down: missed heartbeat deadline", self._name(peer))
                self._member_gone(peer, "missed the heartbeat deadline")
                await self._drop_session(peer)
            if expired:
                await self._push_members()

    def _name(self, peer: NodeId) -> str:
        record = self.registry.nodes.get(peer)
        return f"{record.name} ({peer})" if record else str(peer)

    # -- handlers ----------------------------------------------------------------------------------------

    async def _handle_discover(self, stream: Stream) -> None:
        await serve_discover(stream, lambda: DiscoverReply(coordinator=self.transport.peer_id,
                                                           addrs=self.transport.listen_addrs()))

    async def _handle_probe(self, stream: Stream) -> None:
        await serve_probe(stream, self.registry.is_member)

    async def _handle_ctl(self, stream: Stream) -> None:
        peer = stream.remote_peer
        framed = FramedStream(stream)
        try:
            first = await framed.expect_msg(ctl_decoder)
        except ProtocolError as exc:
            await framed.reject("bad_message", str(exc))
            return
        if not isinstance(first, Join):
            # Anything but a join from a peer without a session: it is not (yet) a member here.
            await framed.reject("not_member", f"{type(first).__name__} before join; send join first")
            return
        admission = self.registry.admit(peer, first, now=trio.current_time(), wall=time.time())
        if not admission.admitted:
            log.warning("refused %s (%s): %s", first.name, peer, admission.reason)
            await framed.send_msg(Refuse(reason=admission.reason))
            await framed.aclose()
            return
        log.info("%s %s (%s, %s)", "re-admitted" if admission.rejoined else "admitted",
                 first.name, peer, first.profile.device)
        if first.listen_addrs:
            self.transport.add_peer_addrs(peer, list(first.listen_addrs))
        old = self._sessions.pop(peer, None)
        if old is not None:
            await old.framed.reject("superseded", "a newer control stream from the same peer replaced this one")
        session = _Session(peer, framed)
        self._sessions[peer] = session
        try:
            # The members hear of the newcomer before it hears it is in, so its first streams to them are
            # rarely early (nodes also wait a moment for a push that names an unknown peer).
            await self._push_members(skip=peer)
            await framed.send_msg(Welcome(
                peer_id=peer,
                heartbeat_interval_s=self.config.heartbeat_interval_s,
                heartbeat_deadline_s=self.config.heartbeat_deadline_s,
                members=[r.member_info() for r in self.registry.members()],
            ))
            self._poke()
            self.probes.member_joined(peer)
            if self.deployment is not None:
                self.deployment.membership_changed(f"{first.name} joined")
            await self._serve_session(session)
        finally:
            if self._sessions.get(peer) is session:
                del self._sessions[peer]
                if self.registry.mark(peer, "down", "control stream closed"):
                    self._member_gone(peer, "lost its control stream")
                    log.warning("node %s marked down: control stream closed", self._name(peer))
                    self._poke()
                    with trio.CancelScope(shield=True), trio.move_on_after(2):
                        await self._push_members()

    async def _serve_session(self, session: _Session) -> None:
        peer, framed = session.peer, session.framed
        while True:
            try:
                msg = await framed.receive_msg(ctl_decoder)
            except ProtocolError as exc:
                await framed.reject("bad_message", str(exc))
                return
            except StreamClosed:
                return
            if msg is None:
                return
            # The session's peer was admitted, but it may have been marked down since (late heartbeat):
            # a down node must join again before anything else it says counts.
            if not self.registry.is_member(peer):
                await framed.reject("not_member", "membership lapsed; join again")
                return
            if isinstance(msg, Heartbeat):
                self.registry.heartbeat(peer, msg.load, now=trio.current_time(), wall=time.time())
                if self.deployment is not None:
                    self.deployment.on_load(peer, msg.load)
                if self.generator is not None and msg.hops:
                    self.generator.hop_reports(peer, msg.hops)
                self._poke()
            elif isinstance(msg, LinkReport):
                stored = self.registry.report_links(peer, msg.links)
                log.debug("%d link measurements from %s", stored, self._name(peer))
                self.probes.on_report(peer, msg)
                self._poke()
            elif isinstance(msg, AssignmentStatus):
                record = self.registry.nodes[peer]
                a = record.assignment
                if a and a.plan_version == msg.plan_version:
                    record.assignment_state = msg.state
                    if msg.state == "ready" and self.generator is not None:
                        # Its old shard stays until the sessions on it have moved away with their KV.
                        self.generator.node_replaced(peer, a.first_layer, a.last_layer)
                if self.deployment is not None:
                    self.deployment.on_status(peer, msg)
            elif isinstance(msg, Leave) and msg.drain_s > 0:
                # It goes once its sessions have moved with their KV; nothing new is routed or planned there.
                if self.registry.drain(peer):
                    log.info("node %s is leaving (%s); its sessions move with their KV", self._name(peer),
                             msg.reason or "no reason given")
                    if self.generator is not None:
                        self.generator.node_leaving(peer)
                    if self.deployment is not None:
                        self.deployment.node_down(peer)
                        self.deployment.membership_changed(f"{self._name(peer)} leaving")
                    self._poke()
            elif isinstance(msg, Leave):
                if self.generator is not None and not await self.generator.kv_delivered(peer, _KV_DELIVERY_S):
                    log.warning("node %s leaves before the KV it sent reached every session", self._name(peer))
                self.registry.mark(peer, "left", msg.reason or "left")
                self._member_gone(peer, "left")
                log.info("node %s left: %s", self._name(peer), msg.reason or "no reason given")
                self._poke()
                await self._push_members(skip=peer)
                await framed.aclose()
                return
            elif isinstance(msg, ErrorReply):
                log.warning("node %s reported an error: %s: %s", self._name(peer), msg.code, msg.message)
            else:
                await framed.reject("bad_message", f"unexpected {type(msg).__name__} from a node")
                return

    def _member_gone(self, peer: NodeId, reason: str) -> None:
        self.probes.member_gone(peer)
        if self.generator is not None:
            self.generator.node_down(peer, reason)
        if self.deployment is not None:
            self.deployment.node_down(peer)
            self.deployment.membership_changed(f"{self._name(peer)} {reason}")

    async def _send_ctl(self, peer: NodeId, msg: ProbeOrder | Assignment) -> bool:
        session = self._sessions.get(peer)
        if session is None:
            log.info("no control stream to %s for %s", self._name(peer), type(msg).__name__)
            return False
        try:
            with trio.move_on_after(_CTL_SEND_S):
                await session.framed.send_msg(msg)
                return True
            log.info("could not send %s to %s within %g s", type(msg).__name__, self._name(peer), _CTL_SEND_S)
        except (StreamClosed, OSError) as exc:
            log.info("could not send %s to %s: %s", type(msg).__name__, self._name(peer), exc)
        return False

    async def _drop_session(self, peer: NodeId) -> None:
        session = self._sessions.pop(peer, None)
        if session is not None:
            await session.framed.reject("marked_down", "missed the heartbeat deadline; join again")

    async def _push_members(self, skip: NodeId | None = None) -> None:
        members = Members(version=self.registry.version,
                          members=[r.member_info() for r in self.registry.members()])
        for peer, session in list(self._sessions.items()):
            if peer == skip:
                continue
            try:
                with trio.move_on_after(5):
                    await session.framed.send_msg(members)
            except (StreamClosed, OSError) as exc:
                log.info("could not push membership to %s: %s", self._name(peer), exc)

    # -- views -------------------------------------------------------------------------------------------

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (bounded) until predicate() holds, re-checking on every registry change; its final value."""
        with trio.move_on_after(timeout_s):
            while not predicate():
                await self._changed.wait()
        return predicate()

    def cluster_view(self) -> dict[str, object]:
        view = self.registry.snapshot()
        view["coordinator"] = {"peer_id": self.transport.peer_id, "addrs": self.transport.listen_addrs()}
        if self.generator is not None:
            g = self.generator
            # Moves that re-prefilled the whole context, and moves that took the KV along (graceful leaves).
            view["moves"] = {"reprefilled": g.reroutes, "with_kv": g.migrations,
                             "recomputed_tokens": g.recomputed_tokens}
        return view
