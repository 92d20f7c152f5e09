"""Requests through the network: the coordinator's `Generator` over routes of nodes (Helix §2.1).

For each request the coordinator asks `route_for` for a route (today: one mixed phase, the request's own
pipeline from the plan's scheduler), installs it once on every hop (Install: the sampling parameters, the
context length, max_tokens, a lease), and sends the context's token ids to the first hop in one message. From
then on the nodes run the request by themselves: the first hop chunks the prefill, the last hop samples, streams
each token here and feeds it straight back to the first hop, and stops at a stop token or at max_tokens. The
coordinator is not on the per-token path, but it owns the request: it checks every token's position, ends it on
a stop string, a limit or a client that left (Release to every hop), renews the leases of its live sessions, and
moves it when its route breaks. Tokens queue here per session, so nothing a node does waits for the HTTP client.

A request outlives the route it started on. When a node of its route goes down, a hop fails the session
(Failed: a dead neighbour, or "shard replaced" after a re-plan), the first hop is unreachable, or no token comes
within the step timeout, the request moves: its session on the old route is released on the hops still up,
`route_for` gives a route that avoids the nodes that failed it, and a fresh session there re-prefills the prompt
plus every token generated so far, sampling the next token of the same stream (greedy output equals an
undisturbed run). After `max_reroutes` moves, or when no route of live nodes appears in time, the request ends
with a clear error; a hop whose whole KV pool is too small for the context ends it at once (a 400). Those
decisions are the lifecycle policy's (`hetnode.policy.Lifecycle`), which the simulator asks too.

A phase-split route hands the prompt's KV from the prefill phase to the decode phase. Where the scheduler books
the decode KV at admission, the decode hops reserve it at the Install and the context goes out once they are all
Ready. Where it books it at the hand-off (decode_booking "handoff", ThunderServe's KV queues), the context goes
out at once and the Install says `kv_queued`: the prefill hops keep the KV they compute, and the first token still
streams at once. When the scheduler names the request's hand-off (`Deployment.on_handoff`, after any event that
can free the decode replica's KV) the decode hops get a Reserve, each reserves (waiting for room if it must) and
answers Ready, and the last Ready sends every prefill hop a SendKV; each sends the KV and says HandedOver, which
frees the prefill side in the scheduler. While the hand-off waits to be named, the request waits without the step
deadline (it is in the scheduler's queue, as at admission); once named, the deadline holds again.
"""

from __future__ import annotations

import itertools
import logging
import math
import secrets
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass

import msgspec
import trio
from transformers import PreTrainedTokenizerBase

from hetnode.coordinator.deployment import Deployment
from hetnode.coordinator.generation import GenerationError, GenerationParams, TokenEvent
from hetnode.coordinator.registry import Registry
from hetnode.coordinator.request_ids import new_request_id, valid_request_id
from hetnode.coordinator.traces import RequestTrace, TraceStore, route_json
from hetnode.errors import HetnodeError
from hetnode.ids import NodeId, SessionId
from hetnode.models.config import ModelConfig
from hetnode.policy import Cause, Lifecycle
from hetnode.policy.kv_codec import (
    AUTO,
    HandoffLink,
    KVCodecPolicy,
    LinkEstimate,
    choose_handoff,
    reprefill_seconds,
)
from hetnode.protocol.kv_wire import packed_size
from hetnode.protocol.mailbox import Mailbox
from hetnode.protocol.messages import (
    INFER_PROTOCOL,
    ErrorReply,
    Export,
    Failed,
    Freeze,
    Frozen,
    HandedOver,
    Hop,
    HopReport,
    Install,
    Item,
    Items,
    KVLink,
    Phase,
    Ready,
    Release,
    Renew,
    Reserve,
    Route,
    Sampling,
    SendKV,
    TensorMeta,
    Token,
    Tokens,
    infer_decoder,
)
from hetnode.protocol.routes import (
    describe,
    kv_targets,
    phase_span,
    pipeline_route,
    queues_kv,
    route_peers,
    route_problem,
)
from hetnode.protocol.transport import Transport
from hetnode.sampling_params import SamplingParams

log = logging.getLogger(__name__)
_EARLY_TOKENS = 16  # tokens that may wait for an earlier one (a phase hand-off overtaken by the next phase)

@dataclass(frozen=True)
class _Leaving:
    """The coordinator's word that a hop of the session's last phase is draining (it leaves), or that its layers
    changed in a re-plan (`replaced`: it stays, and may serve the moved session with its new layers)."""

    peer: NodeId
    replaced: bool = False


_Inbound = Token | Failed | Ready | Frozen | _Leaving | str  # str: the coordinator's own verdict (a node went down)

RouteFor = Callable[[set[NodeId]], Awaitable[list[Hop] | Route]]
"""A route of up nodes (or a pipeline: one mixed phase) that covers every layer once per phase and uses no node
of `exclude`. It waits until there is one; the caller bounds the wait."""


def wire_sampling(p: SamplingParams) -> Sampling:
    return Sampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                    seed=None if p.seed is None else p.seed % (1 << 63),
                    stop_token_ids=list(p.stop_token_ids), logprobs=p.logprobs)


def token_ids_frame(ids: list[int]) -> tuple[TensorMeta, bytes]:
    """Token ids as the raw frame a first hop takes: little-endian int64, no torch needed here."""
    return TensorMeta(dtype="int64", shape=[len(ids)]), b"".join(i.to_bytes(8, "little") for i in ids)


class _Session:
    """One request's presence on one route: the session id its hops know it by, and its inbox."""

    def __init__(self, session_id: SessionId, route: Route, capacity: int) -> None:
        self.id = session_id
        self.set_route(route)
        self.ready: set[NodeId] = set()
        self.prefilled = False  # its first token came: the prefill phase is done
        self.leaving: set[NodeId] = set()  # hops of its last phase that are draining: move it, KV and all
        self.replaced: set[NodeId] = set()  # those of them that stay, with other layers after a re-plan
        self.frozen: dict[NodeId, int] = {}  # answers to Freeze: each hop's computed positions
        self.handed: set[NodeId] = set()  # hops of its earlier phases done with it (HandedOver)
        # ThunderServe's KV queues (Install.kv_queued): its prefill hops keep the KV until the scheduler lets the
        # hand-off start; then its decode hops reserve (`booked`: Reserve sent) and, once all are Ready, the
        # prefill hops send (`sending`: SendKV sent).
        self.queued = False
        self.booked = False
        self.sending = False
        # The wait for its next message (`_next`): while a queued hand-off waits for the decode replica's room it
        # has no deadline (the scheduler's queue, as at admission); booking the hand-off starts the step timeout.
        self.wait: trio.CancelScope | None = None
        # Tokens that came before an earlier one: a decode phase's second token may overtake the prefill phase's
        # first (they come from different hops, over different streams).
        self.early: dict[int, Token] = {}
        # Room for every token the session may produce and a few failure notices: a node never waits for a
        # slow HTTP client, and a token is never dropped.
        self.send, self.recv = trio.open_memory_channel[_Inbound](capacity + 16)

    def set_route(self, route: Route) -> None:
        """The route the session runs (before it is installed: its codecs, or a re-prefill, are chosen late)."""
        self.route = route
        self.peers = {NodeId(p) for p in route_peers(route)}
        self.first = NodeId(route.phases[0].hops[0].peer)
        # Tokens come from the last hop of a phase that samples: a prefill phase's first token, then the rest.
        self.samplers = {NodeId(phase.hops[-1].peer) for phase in route.phases}
        # Hops that start from handed-over KV: the prefill starts when each has reserved it (Ready).
        self.receivers = {NodeId(h.peer) for phase in route.phases[1:] for h in phase.hops}
        # Hops that hand KV on to a later phase: each says when its part is done (HandedOver).
        self.handers = {NodeId(h.peer) for phase in route.phases[:-1] for h in phase.hops}


@dataclass(frozen=True)
class _Lost:
    """Why a route cannot go on with a request; `suspects` are nodes to avoid until liveness judges them."""

    reason: str
    code: str  # node_down, stage_failed, stage_unreachable, timeout
    suspects: frozenset[NodeId] = frozenset()
    cause: Cause = "lost"


class _Request:
    def __init__(self, prompt: list[int], params: GenerationParams, session: _Session, trace: RequestTrace) -> None:
        self.prompt = prompt
        self.params = params
        self.session = session
        self.trace = trace
        self.generated: list[int] = []


class RoutedEvents:
    """A generation's tokens, and the route it runs on (`route`: node names and layers, per phase)."""

    def __init__(self, events: AsyncIterator[TokenEvent], route: str, trace_id: str = "") -> None:
        self._events = events
        self.route = route
        self.trace_id = trace_id

    def __aiter__(self) -> AsyncIterator[TokenEvent]:
        return self._events


class PipelineGenerator:
    def __init__(self, transport: Transport, registry: Registry, deployment: Deployment, *, model_name: str,
                 model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase, step_timeout_s: float = 120.0,
                 ready_timeout_s: float = 30.0, max_reroutes: int = 3, lease_s: float = 30.0,
                 route_for: RouteFor | None = None, kv_codec: str = AUTO, trace_history: int = 1024) -> None:
        self.transport = transport
        self.registry = registry
        self.deployment = deployment
        self.model_name = model_name
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.step_timeout_s = step_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.max_reroutes = max_reroutes  # the move policy's bound (tests set it on a running generator)
        self.lease_s = lease_s
        self.kv_codecs = KVCodecPolicy(kv_codec)  # the operator's --kv-codec, for every hand-off
        # Where requests go: by default each request's own pipeline from the plan's scheduler; tests inject
        # a fixed policy.
        self.route_for: RouteFor | None = route_for
        self.mailbox = Mailbox(transport, INFER_PROTOCOL, infer_decoder, self._on_message, registry.is_member)
        self._sessions: dict[SessionId, _Session] = {}
        self._ids = itertools.count()
        self._nursery: trio.Nursery | None = None
        self._releasing = 0
        self._released = trio.Event()
        self._active = 0
        self.reroutes = 0  # moves of requests to another route that re-prefilled the context, since start
        self.migrations = 0  # moves that took the request's KV along (its nodes left gracefully)
        self.recomputed_tokens = 0  # positions such moves computed again (those past the KV the hops had)
        self.reprefilled_tokens = 0  # positions re-prefilled by the moves that left their KV behind (/metrics)
        self._progress = trio.Event()  # set when a session gets its first token or ends
        # The latest hand-offs, for GET /v1/plan: each session's links, codecs and bytes (or its re-prefill).
        self.handoffs: deque[dict[str, object]] = deque(maxlen=64)
        # GET /v1/requests/{id}: the latest `trace_history` requests' routes, phases, hops and moves.
        self.traces = TraceStore(trace_history)
        # Packed KV bytes the hops reported sending, by (sender, receiver, codec) node names, since start.
        self.kv_moved: Counter[tuple[str, str, str]] = Counter()
        # Hand-offs booked when they start (decode_booking "handoff"): at the first token, or after waiting for
        # the decode replica's KV room (/metrics).
        self.kv_queue: Counter[str] = Counter()
        deployment.on_handoff = self._handoff_may_start

    def hop_reports(self, peer: NodeId, reports: list[HopReport]) -> None:
        """A heartbeat's reports of sessions that ended on `peer`: into their traces and the KV totals."""
        names = {str(p): r.name for p, r in self.registry.nodes.items()}
        src = names.get(str(peer), str(peer))
        for report in reports:
            if self.traces.hop_report(report, str(peer), names):
                # Counted only for sessions this coordinator routed through `peer` (the trace checked it).
                for k in report.kv_sent:
                    self.kv_moved[(src, names.get(k.dst, k.dst), k.codec)] += k.bytes

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                self.mailbox.install()
                nursery.start_soon(self._renew_leases)
                task_status.started()
                await trio.sleep_forever()
        finally:
            # The control handlers outlive this during shutdown; a node they see go must not start a task in a
            # closed nursery (that raised inside the handler).
            self._nursery = None

    @property
    def lifecycle(self) -> Lifecycle:
        """The shared lifecycle policy, at this generator's bound (tests change `max_reroutes` on a running one)."""
        return Lifecycle(self.max_reroutes)

    @property
    def active_sessions(self) -> int:
        """Requests in flight (a request that is moving between routes counts once)."""
        return self._active

    async def _route(self, session: SessionId, input_len: int, exclude: set[NodeId]) -> Route:
        """A route of up nodes avoiding `exclude`, waiting for one (the caller bounds the wait)."""
        if self.route_for is not None:
            route = await self.route_for(exclude)
            return route if isinstance(route, Route) else pipeline_route(route)
        return await self.deployment.route(session, input_len, exclude)

    def with_codecs(self, route: Route, prefill_end: int) -> Route:
        """`route` with a codec on every link of every hand-off that does not name one (`choose_handoff`: the
        cheapest of packing, sending and unpacking at the link's measured bandwidth and the two nodes' measured
        codec rates; fp16, or the operator's codec, where something is not measured yet), or, under `auto`, one
        mixed phase on the decode pipeline when it re-prefills the context sooner than any link moves its KV."""
        if len(route.phases) < 2:
            return route
        phases = list(route.phases)
        # Prefill then decode of the whole context: under --kv-codec auto the decode side may re-prefill it.
        whole = len(phases) == 2 and phases[0].last_token is None and not phases[0].kv_links
        reprefill_s = reprefill_seconds(prefill_end, [self._prefill_rate(NodeId(h.peer)) for h in phases[1].hops]
                                        ) if whole else None
        for p, phase in enumerate(route.phases[:-1]):
            if phase.kv_links:
                continue  # a route that names its codecs keeps them
            _, end = phase_span(route, p, prefill_end)
            assert end is not None
            pairs = [(hop, target) for hop in phase.hops for target in kv_targets(route, p, hop)]
            codecs, reprefill = choose_handoff(self.kv_codecs, [
                self._handoff_link(NodeId(hop.peer), NodeId(t.peer), t.last_layer - t.first_layer, end)
                for hop, t in pairs], reprefill_s if p == 0 else None)
            if reprefill:
                log.info("re-prefilling %d tokens on the decode side (about %.3f s) is cheaper than handing over "
                         "the KV", prefill_end, reprefill_s)
                self.handoffs.append({"at": time.time(), "tokens": prefill_end, "reprefill_s": reprefill_s,
                                      "links": []})
                return pipeline_route(route.phases[1].hops)
            phases[p] = msgspec.structs.replace(phase, kv_links=[
                KVLink(src=hop.peer, dst=t.peer, codec=c)  # type: ignore[arg-type]
                for (hop, t), c in zip(pairs, codecs, strict=True)])
        return Route(phases=phases)

    def _prefill_rate(self, peer: NodeId) -> float:
        record = self.registry.nodes.get(peer)
        return record.load.prefill_tokens_per_s if record is not None else 0.0

    def _handoff_link(self, src: NodeId, dst: NodeId, layers: int, tokens: int) -> HandoffLink:
        """What the policy chooses one link's codec from: the packed sizes, the two nodes' measured rates (from
        their heartbeats) and the link as probed."""
        cfg = self.model_config
        names = {r.codec for peer in (src, dst) if (rec := self.registry.nodes.get(peer)) is not None
                 for r in rec.load.kv_codec_rates} | {"fp16"}
        send = self.registry.nodes.get(src)
        recv = self.registry.nodes.get(dst)
        probed = self.registry.links.get((src, dst))
        return HandoffLink(
            sizes={n: packed_size(n, layers, tokens, cfg.num_kv_heads, cfg.head_dim) for n in names},
            pack={r.codec: r.pack for r in (send.load.kv_codec_rates if send else [])},
            unpack={r.codec: r.unpack for r in (recv.load.kv_codec_rates if recv else [])},
            link=None if probed is None else LinkEstimate(bandwidth=max(probed.bandwidth_mbps, 1e-3) * 1e6 / 8,
                                                          latency=probed.rtt_ms / 2000))

    def _new_id(self) -> SessionId:
        return SessionId(f"s{next(self._ids)}-{secrets.token_hex(6)}")

    # -- inbound -----------------------------------------------------------------------------------------

    async def _on_message(self, peer: NodeId, msg: object, payload: bytes | None) -> None:
        if isinstance(msg, Tokens):
            for token in msg.tokens:
                self._to_session(peer, token.session, token)
        elif isinstance(msg, Failed | Ready | Frozen):
            self._to_session(peer, msg.session, msg)
        elif isinstance(msg, HandedOver):
            self._handed_over(peer, msg)
        elif isinstance(msg, ErrorReply):
            log.warning("data path error from %s: %s: %s", self._name(peer), msg.code, msg.message)
        else:
            log.warning("unexpected %s from %s on the data path", type(msg).__name__, self._name(peer))

    def _to_session(self, peer: NodeId, session_id: str, msg: Token | Failed | Ready | Frozen) -> None:
        session = self._sessions.get(SessionId(session_id))
        # Tokens come only from the last hop of a phase that samples, Ready only from a hop that is handed KV,
        # failures from any of its hops; anything else (a moved request's old session, another peer speaking
        # for it) is ignored.
        if session is None:
            return
        allowed = (session.samplers if isinstance(msg, Token) else session.receivers if isinstance(msg, Ready)
                   else session.peers)
        if peer not in allowed:
            log.warning("session %s: %s from %s, which may not send it", session_id, type(msg).__name__,
                        self._name(peer))
            return
        if isinstance(msg, Ready):
            if session.queued and not session.booked:
                log.warning("session %s: Ready from %s before its hand-off was booked", session_id, self._name(peer))
                return
            session.ready.add(peer)
            if session.queued and not session.sending and session.receivers <= session.ready:
                session.sending = True
                self._nursery_soon(self._tell, session, {NodeId(h.peer) for h in session.route.phases[0].hops},
                                   SendKV(session=session.id))
        elif isinstance(msg, Frozen):
            session.frozen[peer] = msg.end
        try:
            session.send.send_nowait(msg)
        except trio.WouldBlock:
            log.warning("session %s: more results from %s than it can produce; dropped", session_id, peer)

    def _handed_over(self, peer: NodeId, msg: HandedOver) -> None:
        """Once every hop of the earlier phases is done with the session, the scheduler hears it (Cronus frees the
        PPI's place then, rather than at the first token, which comes a whole CPI prefill later)."""
        session = self._sessions.get(SessionId(msg.session))
        if session is None or session.handed >= session.handers:
            return  # a moved request's old session, or told already
        if peer not in session.handers:
            log.warning("session %s: HandedOver from %s, which hands it nothing", msg.session, self._name(peer))
            return
        session.handed.add(peer)
        if session.handed >= session.handers:
            self.traces.handed_over(session.id, trio.current_time())
            self.deployment.route_partial_done(session.id)

    def _handoff_may_start(self, key: str) -> None:
        """The scheduler booked the decode KV of session `key` (its hand-off may start): its decode hops reserve
        it, waiting there for room if they must, and say Ready; the last Ready lets the prefill hops send."""
        session = self._sessions.get(SessionId(key))
        if session is None or not session.queued or session.booked:
            return  # ended or moved meanwhile, or a route that hands nothing over (re-prefilled on the decode side)
        session.booked = True
        if session.wait is not None:
            session.wait.deadline = trio.current_time() + self.step_timeout_s
        log.debug("session %s: its decode KV is booked; the hand-off starts", key)
        self._nursery_soon(self._tell, session, session.receivers, Reserve(session=session.id))

    async def _tell(self, session: _Session, peers: set[NodeId], msg: Reserve | SendKV) -> None:
        """Send `msg` to every one of `peers` at once; one that cannot be reached fails the session (the request
        then moves as the lifecycle says)."""
        if self._sessions.get(session.id) is not session:
            return  # it ended meanwhile (a first token that was also its last): its Release frees everything

        async def one(peer: NodeId) -> None:
            try:
                await self.mailbox.send(peer, msg)
            except HetnodeError as exc:
                with suppress(trio.WouldBlock):
                    session.send.send_nowait(f"hop {self._name(peer)} is unreachable: {exc}")

        with trio.move_on_after(self.step_timeout_s):
            async with trio.open_nursery() as nursery:
                for peer in peers:
                    nursery.start_soon(one, peer)

    def node_leaving(self, peer: NodeId) -> None:
        """`peer` drains before it leaves: every session whose KV it holds moves with that KV to other nodes
        (at its next token, or once prefilled). Sessions it only prefilled for are done with it by then: it
        finishes sending their KV before it goes."""
        for session in self._sessions.values():
            if peer in {NodeId(h.peer) for h in session.route.phases[-1].hops}:
                self._tell_leaving(session, _Leaving(peer))

    def node_replaced(self, peer: NodeId, first_layer: int, last_layer: int) -> None:
        """`peer` serves layers [first_layer, last_layer) now (none when they are equal) and keeps its old shard
        only until the sessions on it have gone: each session whose last phase has it on other layers moves
        with its KV, as from a node that leaves, but `peer` itself stays eligible for the new route."""
        for session in self._sessions.values():
            if any(NodeId(h.peer) == peer and (h.first_layer, h.last_layer) != (first_layer, last_layer)
                   for h in session.route.phases[-1].hops):
                session.replaced.add(peer)
                self._tell_leaving(session, _Leaving(peer, replaced=True))

    @staticmethod
    def _tell_leaving(session: _Session, word: _Leaving) -> None:
        session.leaving.add(word.peer)
        with suppress(trio.WouldBlock):
            session.send.send_nowait(word)

    def _progressed(self) -> None:
        self._progress.set()
        self._progress = trio.Event()

    async def kv_delivered(self, peer: NodeId, timeout_s: float) -> bool:
        """Until no session waits for KV from `peer` (it is on an earlier phase of a session whose first token
        has not come), at most `timeout_s`: a node that leaves gracefully stays a member until then, so that
        the KV it sent is not refused as a non-member's. True if none waits."""
        def waiting() -> bool:
            return any(peer in s.handers and (not s.prefilled or (s.queued and peer not in s.handed))
                       for s in self._sessions.values())

        with trio.move_on_after(timeout_s):
            while waiting():
                await self._progress.wait()
        return not waiting()

    def node_down(self, peer: NodeId, reason: str) -> None:
        """Tell every session that `peer` going down fails (the lifecycle policy's `fails_when_down`, which the
        simulator asks too): its request moves to another route."""
        for session in self._sessions.values():
            phases = [{h.peer for h in phase.hops} for phase in session.route.phases]
            holding = {str(p) for p in session.handers - session.handed} if session.queued else set()
            if self.lifecycle.fails_when_down(str(peer), phases, left=reason == "left", holding=holding):
                with suppress(trio.WouldBlock):
                    session.send.send_nowait(f"node {self._name(peer)} went down ({reason})")
        self._nursery_soon(self.mailbox.forget, peer)

    def _name(self, peer: NodeId) -> str:
        record = self.registry.nodes.get(peer)
        return record.name if record else str(peer)

    def _nursery_soon(self, fn: object, *args: object) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)  # type: ignore[arg-type]

    # -- sessions ----------------------------------------------------------------------------------------

    def _open(self, session_id: SessionId, route: Route, max_tokens: int) -> _Session:
        session = _Session(session_id, route, max_tokens)
        self._sessions[session.id] = session
        return session

    def _close(self, session: _Session, output_len: int | None) -> None:
        """Forget the session, tell the scheduler (after `output_len` tokens, or None: moved away), and free
        its KV on every hop of its route."""
        self.deployment.route_done(session.id, output_len)
        self.traces.session_ended(session.id, "finished" if output_len is not None else "moved", trio.current_time())
        self._progressed()
        if self._sessions.pop(session.id, None) is None or self._nursery is None:
            return
        # Counted now, not when the task starts, so that wait_released right after a generation sees it.
        self._releasing += 1
        self._nursery.start_soon(self._release, session.id, session.peers)

    async def _release(self, session: SessionId, peers: set[NodeId]) -> None:
        async def one(peer: NodeId) -> None:
            with trio.move_on_after(5):
                try:
                    await self.mailbox.send(peer, Release(session=session))
                except HetnodeError as exc:
                    log.info("release of %s at %s failed: %s", session, self._name(peer), exc)

        try:
            # Every hop, even one marked down: it may be back, still holding the KV. Concurrently, so a dead
            # one does not hold up the others.
            async with trio.open_nursery() as nursery:
                for peer in peers:
                    nursery.start_soon(one, peer)
        finally:
            self._releasing -= 1
            if not self._releasing:
                self._released.set()
                self._released = trio.Event()

    async def wait_released(self) -> None:
        """Until every finished session's Release has been handed to its hops' streams."""
        if self._releasing:
            await self._released.wait()

    async def _renew_leases(self) -> None:
        """Tell every hop which of its sessions are still alive, well before their leases run out."""
        while True:
            await trio.sleep(self.lease_s / 3)
            by_peer: dict[NodeId, list[str]] = {}
            for session in self._sessions.values():
                for peer in session.peers:
                    by_peer.setdefault(peer, []).append(session.id)
            for peer, sessions in by_peer.items():
                self._nursery_soon(self._renew, peer, sessions)

    async def _renew(self, peer: NodeId, sessions: list[str]) -> None:
        with trio.move_on_after(self.lease_s / 3):
            try:
                await self.mailbox.send(peer, Renew(sessions=sessions))
            except HetnodeError as exc:
                log.info("renewing leases at %s failed: %s", self._name(peer), exc)

    # -- generation --------------------------------------------------------------------------------------

    @asynccontextmanager
    async def generate(self, prompt_ids: list[int], params: GenerationParams,
                       ) -> AsyncIterator[AsyncIterator[TokenEvent]]:
        if not prompt_ids:
            raise GenerationError("the prompt is empty", status=400, code="invalid_prompt")
        if params.max_tokens < 1:
            raise GenerationError("max_tokens must be at least 1", status=400, code="invalid_max_tokens")
        route = None
        session_id = self._new_id()
        trace_id = params.trace_id if valid_request_id(params.trace_id) else new_request_id()
        trace = self.traces.open(trace_id, len(prompt_ids), params.max_tokens, trio.current_time())
        self.deployment.request_arrived(len(prompt_ids))
        try:
            with trio.move_on_after(self.ready_timeout_s):
                route = await self._route(session_id, len(prompt_ids), set())
        except BaseException as exc:
            self.deployment.route_done(session_id, None)
            self.traces.finished(trace, "failed" if isinstance(exc, Exception) else "cancelled", 0, str(exc),
                                 trio.current_time())
            raise
        if route is None:
            why = f"no pipeline is ready to serve: {self.deployment.why_not_ready()}"
            self.traces.finished(trace, "failed", 0, why, trio.current_time())
            raise GenerationError(why, status=503, code="no_capacity")
        request = _Request(list(prompt_ids), params, self._open(session_id, route, params.max_tokens), trace)
        self._active += 1
        names = {str(p): self._name(p) for p in request.session.peers}
        status, error = "cancelled", "the client went away"
        try:
            yield RoutedEvents(self._events(request), describe(route, names), trace_id)
            status, error = "completed", ""
        except Exception as exc:
            status, error = "failed", str(exc)
            raise
        finally:
            self._active -= 1
            self._close(request.session, len(request.generated))
            self.deployment.request_finished(len(request.generated))
            self.traces.finished(trace, status, len(request.generated), error,  # type: ignore[arg-type]
                                 trio.current_time())

    async def _events(self, request: _Request) -> AsyncIterator[TokenEvent]:
        moves = 0
        params = request.params
        lost = await self._start(request)
        while True:
            while lost is None:
                msg = await self._next(request.session)
                if isinstance(msg, _Lost):
                    lost = msg
                    break
                for tok in self._in_order(request, msg):
                    yield self._accept(request, tok)
                    if self.lifecycle.ends(len(request.generated), params.max_tokens, tok.stopped):
                        return
                if request.session.leaving:
                    lost = self._leaving(request.session)
            if lost.code == "leaving":
                # A graceful leave: the session moves with its KV; only when that cannot be done, re-prefilled.
                late, frozen = await self._freeze(request.session, lost)
                for tok in (t for msg in late for t in self._in_order(request, msg)):
                    yield self._accept(request, tok)
                    if self.lifecycle.ends(len(request.generated), params.max_tokens, tok.stopped):
                        return
                lost = await self._move_with_kv(request, lost) if frozen is None else frozen
                if lost is None:
                    continue
            if not self.lifecycle.moves(lost.cause, moves):
                if lost.cause == "refused":  # the request, not the route, cannot be served
                    raise GenerationError(lost.reason, status=400, code="kv_capacity_exceeded")
                raise GenerationError(f"{lost.reason}; giving up after {self.max_reroutes} re-routes",
                                      status=502, code=lost.code)
            moves += 1
            await self._move(request, lost, moves)
            lost = await self._start(request)

    def _in_order(self, request: _Request, msg: Token) -> list[Token]:
        """The tokens that now continue the context, in order: `msg` and any that came early and follow it; a
        token ahead of the next one waits (a bounded few), one already had is a protocol error (in `_accept`)."""
        expected = len(request.prompt) + len(request.generated)
        early = request.session.early
        if msg.position > expected:
            if len(early) >= _EARLY_TOKENS:
                raise GenerationError(f"out-of-order token (position {msg.position}, expected {expected})",
                                      status=502, code="protocol_error")
            early[msg.position] = msg
            return []
        out = [msg]
        while (nxt := early.pop(out[-1].position + 1, None)) is not None:
            out.append(nxt)
        return out

    def _accept(self, request: _Request, msg: Token) -> TokenEvent:
        """The request's next token, checked to continue its context."""
        expected = len(request.prompt) + len(request.generated)
        if msg.position != expected:
            raise GenerationError(f"out-of-order token (position {msg.position}, expected {expected})",
                                  status=502, code="protocol_error")
        request.generated.append(msg.token)
        if not request.session.prefilled:
            self.traces.first_token(request.trace, request.session.id, trio.current_time())
            request.session.prefilled = True
            self.deployment.route_prefilled(request.session.id)  # may book its queued hand-off at once
            if request.session.queued:
                self.kv_queue["waited" if not request.session.booked else "at_once"] += 1
            self._progressed()
        else:
            self.deployment.route_progress(request.session.id, len(request.generated))
        top = tuple((int(t), float(lp)) for t, lp in msg.top_logprobs) if msg.top_logprobs else None
        return TokenEvent(msg.token, msg.logprob, top, msg.stopped)

    async def _freeze(self, old: _Session, lost: _Lost) -> tuple[list[Token], _Lost | None]:
        """Ask the hops that hold the session's KV (its last phase) to stop it and say how far each computed.
        Returns the tokens that arrived meanwhile (sampled before the freeze reached the last hop: the stream
        keeps them), and None, or why the session cannot move with its KV."""
        holders = [NodeId(h.peer) for h in old.route.phases[-1].hops]
        late: list[Token] = []
        answers = 0
        with trio.move_on_after(self.step_timeout_s):
            try:
                for peer in holders:
                    await self.mailbox.send(peer, Freeze(session=old.id))
            except HetnodeError as exc:
                return late, self._no_kv_move(old, lost, f"freezing it failed: {exc}")
            # Counted as they come out of the inbox, not as they arrive: the tokens a hop sampled before it froze
            # are ahead of its answer there (a slow client leaves many queued), and all of them must be had.
            while answers < len(holders):
                msg = await old.recv.receive()
                if isinstance(msg, Token):
                    late.append(msg)
                elif isinstance(msg, Frozen):
                    answers += 1
                elif isinstance(msg, Failed | str):
                    why = msg if isinstance(msg, str) else msg.reason
                    return late, self._no_kv_move(old, lost, f"a hop failed while it froze: {why}")
        if answers < len(holders):
            return late, self._no_kv_move(old, lost, f"its hops did not freeze within {self.step_timeout_s:g} s")
        return late, None

    def _no_kv_move(self, old: _Session, lost: _Lost, why: str) -> _Lost:
        log.warning("session %s cannot move with its KV (%s): it re-prefills elsewhere", old.id, why)
        return _Lost(f"{lost.reason}; {why}", "node_down", lost.suspects)

    async def _move_with_kv(self, request: _Request, lost: _Lost) -> _Lost | None:
        """Move the frozen request to a route of staying nodes with the KV its last phase holds.

        The new session's route has two phases: the old hops, prefilling up to the least position they all
        computed (so they hand over, per layer, the KV they have), then the new pipeline, which computes what
        follows from there (a token or two) and decodes on. None when the request goes on in the new session,
        else why not (the caller then re-prefills it)."""
        old = request.session
        total = len(request.prompt) + len(request.generated)
        end = min(old.frozen.values())
        if not 0 < end < total:
            return self._no_kv_move(old, lost, f"its hops hold KV of [0, {end}) of a context of {total}")
        session_id = self._new_id()
        fresh = await self._reroute(lost, session_id, total)
        route = Route(phases=[Phase(kind="prefill", hops=list(old.route.phases[-1].hops), last_token=end),
                              Phase(kind="mixed", hops=list(fresh.phases[-1].hops), first_token=end)])
        problem = route_problem(route, self.model_config.num_layers)
        if problem:
            self.deployment.route_done(session_id, None)
            return self._no_kv_move(old, lost, f"no route takes its KV: {problem}")
        request.session = self._open(session_id, route, request.params.max_tokens)
        started = await self._start(request, adopts=old)
        if started is not None:
            self._close(request.session, None)
            request.session = old
            return self._no_kv_move(old, lost, started.reason)
        # The old session's hops free it themselves once they have sent its KV.
        self.deployment.route_done(old.id, None)
        self._sessions.pop(old.id, None)
        self.migrations += 1
        self.recomputed_tokens += total - end
        now = trio.current_time()
        self.traces.session_ended(old.id, "moved", now)
        self.traces.moved(request.trace, "with_kv", lost.reason, old.id, session_id, total - end, now)
        names = {str(p): self._name(p) for p in request.session.peers}
        log.info("session %s moved with its KV to %s as %s (KV of %d positions handed over, %d computed again): %s",
                 old.id, describe(route, names), session_id, end, total - end, lost.reason)
        return None

    async def _start(self, request: _Request, adopts: _Session | None = None) -> _Lost | None:
        """Install the session on every hop of its route and send the context to the first hop.

        `adopts`: the session starts from that (frozen) session's KV: its first phase is that session's hops,
        which get an Export instead of an Install and no context."""
        session = request.session
        context = request.prompt + request.generated
        left = self.lifecycle.restart(len(request.prompt), len(request.generated), request.params.max_tokens)
        session.set_route(self.with_codecs(session.route, left.prefill_end))
        session.queued = adopts is None and queues_kv(session.route) and self.deployment.books_at_handoff(session.id)
        self.traces.session(request.trace, session.id, route_json(session.route, {
            str(p): self._name(p) for p in session.peers}), trio.current_time())
        for p, phase in enumerate(session.route.phases[:-1]):
            _, end = phase_span(session.route, p, left.prefill_end)
            assert end is not None
            links = [{"from": self._name(NodeId(hop.peer)), "to": self._name(NodeId(t.peer)),
                      "layers": [t.first_layer, t.last_layer], "codec": t.codec,
                      "bytes": packed_size(t.codec, t.last_layer - t.first_layer, end, self.model_config.num_kv_heads,
                                           self.model_config.head_dim)}
                     for hop in phase.hops for t in kv_targets(session.route, p, hop)]
            self.handoffs.append({"at": time.time(), "session": session.id, "tokens": end, "links": links})
            log.info("session %s hands over the KV of %d tokens: %s%s", session.id, end, ", ".join(
                f"{k['from']}>{k['to']} layers [{k['layers'][0]},{k['layers'][1]}) {k['codec']} {k['bytes']} bytes"
                for k in links), "; when its decode replica has room" if session.queued else "")
        install = Install(session=session.id, route=session.route, sampling=wire_sampling(request.params.sampling),
                          prefill_end=left.prefill_end, max_tokens=left.max_tokens, lease_s=self.lease_s,
                          adopts=adopts.id if adopts is not None else None, trace=request.trace.id,
                          kv_queued=session.queued)
        try:
            # Exactly the checks the hops make on arrival: a value they would refuse (a NaN that slipped past
            # the API) fails this request here, instead of resetting a stream other requests share.
            infer_decoder.decode(msgspec.msgpack.encode(install))
        except msgspec.ValidationError as exc:
            raise GenerationError(f"the request cannot be sent to the nodes: {exc}", status=400,
                                  code="invalid_request") from exc
        # Each phase's first hop gets the part of the context that phase runs (Helix: all of it to the one
        # phase; phase-split: all of it to the prefill phase; Cronus: [0, k) to the first, the rest to the next).
        parts: dict[NodeId, tuple[int, int]] = {}
        for p, phase in enumerate(session.route.phases):
            start, end = phase_span(session.route, p, left.prefill_end)
            end = left.prefill_end if end is None else end
            if start < end and not (p == 0 and adopts is not None):  # the adopted KV is that part
                parts[NodeId(phase.hops[0].peer)] = (start, end)
        installed = session.peers if adopts is None else {NodeId(h.peer) for ph in session.route.phases[1:]
                                                          for h in ph.hops}
        unreachable: list[tuple[NodeId, str]] = []

        async def send_to(peer: NodeId, msg: Install | Export | None, context_part: bool) -> None:
            try:
                if msg is not None:
                    await self.mailbox.send(peer, msg)
                if context_part and peer in parts:  # the same ordered stream: the Install arrives first
                    start, end = parts[peer]
                    meta, raw = token_ids_frame(context[start:end])
                    await self.mailbox.send(peer, Items(items=[Item(session.id, start, end - start)], tensor=meta),
                                            raw)
            except HetnodeError as exc:
                unreachable.append((peer, str(exc)))

        # Under the step deadline: a stream to a dying peer can block before it fails. The other hops need not
        # have their Install before the first items reach them; they hold such items until it comes. Hops that
        # start from handed-over KV reserve it first, so the context goes out only when all of them are Ready;
        # with queued KV they reserve when the hand-off may start, and the context goes out at once.
        ready_first = bool(session.receivers) and not session.queued
        with trio.move_on_after(self.step_timeout_s) as scope:
            async with trio.open_nursery() as nursery:
                for peer in installed:
                    nursery.start_soon(send_to, peer, install, not ready_first)
            if not unreachable and ready_first:
                lost = await self._wait_ready(session)
                if lost is not None:
                    return lost
                if adopts is not None:  # every receiver holds room for it: the adopted KV goes now
                    export = Export(session=adopts.id, to=session.id, route=session.route)
                    async with trio.open_nursery() as nursery:
                        for hop in session.route.phases[0].hops:
                            nursery.start_soon(send_to, NodeId(hop.peer), export, False)
                async with trio.open_nursery() as nursery:
                    for peer in parts:
                        nursery.start_soon(send_to, peer, None, True)
        if unreachable:
            peer, why = unreachable[0]
            return _Lost(f"hop {self._name(peer)} is unreachable: {why}", "stage_unreachable",
                         frozenset(p for p, _ in unreachable))
        if scope.cancelled_caught:
            return _Lost(f"installing the route took over {self.step_timeout_s:g} s", "timeout")
        return None

    async def _wait_ready(self, session: _Session) -> _Lost | None:
        """Until every hop that starts from handed-over KV has reserved it (the caller bounds the wait)."""
        while not session.receivers <= session.ready:
            msg = await session.recv.receive()
            if isinstance(msg, Failed | str):  # (a token cannot come before the context goes out)
                return self._lost(msg)
        return None

    async def _next(self, session: _Session) -> Token | _Lost:
        waiting = session.queued and session.prefilled and not session.booked
        with trio.move_on_at(math.inf if waiting else trio.current_time() + self.step_timeout_s) as wait:
            session.wait = wait
            try:
                while True:
                    msg = await session.recv.receive()
                    if isinstance(msg, Token):
                        return msg
                    if isinstance(msg, _Leaving):
                        if session.prefilled:  # else at its first token: a prompt half-way through cannot move
                            return self._leaving(session)
                        continue
                    if not isinstance(msg, Ready | Frozen):  # a Ready after the wait for it changes nothing
                        return self._lost(msg)
            finally:
                session.wait = None
        return _Lost(f"no token from the route within {self.step_timeout_s:g} s", "timeout")

    def _leaving(self, session: _Session) -> _Lost:
        """Why the session moves with its KV: nodes that leave are avoided by its next route, nodes whose
        layers a re-plan changed are not (the new plan routes through them). A queued hand-off that has not
        reached its decode hops leaves them nothing to move with: it re-prefills elsewhere instead."""
        gone = session.leaving - session.replaced
        why = []
        if gone:
            why.append(f"{', '.join(sorted(self._name(p) for p in gone))} {'is' if len(gone) == 1 else 'are'} "
                       "leaving")
        if session.replaced:
            why.append(f"a re-plan changed the layers of {', '.join(sorted(self._name(p) for p in session.replaced))}")
        handed = not session.queued or session.handed >= session.handers
        return _Lost("; ".join(why), "leaving" if handed else "node_down", frozenset(gone))

    def _lost(self, msg: Failed | str) -> _Lost:
        if isinstance(msg, str):
            return _Lost(msg, "node_down")
        suspects = frozenset({NodeId(msg.unreachable)}) if msg.unreachable else frozenset()
        return _Lost(f"hop {self._name(NodeId(msg.hop_peer))} failed: {msg.reason}", "stage_failed", suspects,
                     msg.cause)

    async def _move(self, request: _Request, lost: _Lost, move: int) -> None:
        """Put the request on a route of live nodes, ready to re-prefill what it has so far."""
        old = request.session
        self._close(old, None)
        session_id = self._new_id()
        context = len(request.prompt) + len(request.generated)
        route = await self._reroute(lost, session_id, context)
        request.session = self._open(session_id, route, request.params.max_tokens)
        self.reroutes += 1
        self.reprefilled_tokens += context
        self.traces.moved(request.trace, "reprefill", lost.reason, old.id, session_id, context, trio.current_time())
        names = {str(p): self._name(p) for p in request.session.peers}
        log.warning("session %s moved to %s as %s (re-route %d of %d, re-prefilling %d tokens): %s", old.id,
                    describe(route, names), request.session.id, move, self.max_reroutes, context, lost.reason)

    async def _reroute(self, lost: _Lost, session_id: SessionId, input_len: int) -> Route:
        """A route without the nodes that failed: suspects (alive as far as liveness knows) are avoided for
        long enough for a dead one to be marked down; after that only liveness decides."""
        deadline = trio.current_time() + self.ready_timeout_s
        route = None
        if lost.suspects:
            with trio.move_on_after(min(self.ready_timeout_s, 2 * self.registry.heartbeat_deadline_s)):
                route = await self._route(session_id, input_len, set(lost.suspects))
        if route is None:
            with trio.move_on_at(deadline):
                route = await self._route(session_id, input_len, set())
        if route is None:
            raise GenerationError(f"{lost.reason}; no pipeline of live nodes to move the request to within "
                                  f"{self.ready_timeout_s:g} s: {self.deployment.why_not_ready()}",
                                  status=503, code=lost.code)
        return route


