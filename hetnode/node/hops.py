"""A node's part of the data path: hold the assigned layers, serve the sessions installed on it, pass results on.

An Assignment names a model and a layer range; the node loads only that shard (in the worker thread) and
reports ready. A new layer range is loaded beside the old shard, which goes on serving the sessions installed on
it meanwhile: the ready report is the coordinator's cue to move them to the new plan with their KV, and the old
shard retires once they have gone (or, after a bounded wait, fails those left, whose requests then re-prefill
elsewhere). Only when both shards do not fit is the old one dropped first.

A session exists here only once its coordinator has installed its route (Install), and from then on its items are
accepted only from the peers the route names: from the previous hop, or at a phase's first hop from the
installing coordinator (the prompt) and from the phase's last hop (each decode token, fed straight back); Release
and Renew only from the installing coordinator. Positions must continue exactly where the session stands, so no
peer can rewind or overwrite a session. Items that arrive before their Install (it travels on another stream)
wait for it, bounded in number and time. A session whose coordinator stops renewing its lease is freed.

After each step the node sends one Items message per next hop carrying every item for that hop, through a
per-peer outbox, so the batch loop never waits on the network. The last hop samples, streams the tokens of the
step to their coordinators (one Tokens message each), and feeds every session that goes on back to the first hop
of its phase; it stops a session by itself at a stop token or at max_tokens.

KV hand-offs between phases, and the moves that keep a session's KV, are in kv_handoff.py.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import torch
import trio

from hetnode.errors import HetnodeError, ProtocolError
from hetnode.ids import NodeId, SessionId
from hetnode.kv import codec_rates
from hetnode.node.batcher import BatchLoop, Pace, Work
from hetnode.node.engine import (
    EngineConfig,
    ItemResult,
    StepItem,
    TorchEngine,
)
from hetnode.node.hop_session import HopSession, sampling_params
from hetnode.node.kv_handoff import KVHandoffs
from hetnode.node.metrics import NodeMetrics, NodeView
from hetnode.policy import BatchConfig, BatchPolicy, Cause, KVLedger, KVTransferPolicy, Lifecycle
from hetnode.policy.role_batching import prompt_tokens_for
from hetnode.policy.shards import reloads
from hetnode.protocol.mailbox import Mailbox
from hetnode.protocol.messages import (
    INFER_PROTOCOL,
    KV,
    KV_PROTOCOL,
    MAX_HOP_REPORTS,
    Assignment,
    AssignmentStatus,
    CodecRate,
    ErrorReply,
    Export,
    Failed,
    Freeze,
    HopReport,
    Install,
    Item,
    Items,
    Load,
    Ready,
    Release,
    Renew,
    Reserve,
    SendKV,
    Token,
    Tokens,
    infer_decoder,
    kv_decoder,
)
from hetnode.protocol.outbox import Outbox
from hetnode.protocol.routes import kv_sources, kv_targets, phase_span, places_of, queues_kv, route_problem
from hetnode.protocol.tensors import from_wire, to_wire
from hetnode.protocol.transport import Transport

log = logging.getLogger(__name__)

ReportStatus = Callable[[AssignmentStatus], Awaitable[None]]
PaceFactory = Callable[[TorchEngine], Pace | None]
_RETIRE_TIMEOUT_S = 30.0
_RETIRE_DRAIN_S = 30.0  # a replaced shard's sessions move with their KV within this, or re-prefill
_PARK_SESSIONS = 1024  # sessions whose items may wait for their Install at once
_PARK_ITEMS = 64  # items one such session may have waiting
_PARK_S = 10.0  # how long they wait before they are refused
_PARK_BYTES = 256 << 20  # the tensors they hold, all sessions together (a hostile member cannot fill memory)
_RELEASED_MEMORY = 65536  # sessions released recently: late items for them are dropped quietly


@dataclass
class _Parked:
    since: float
    items: list[tuple[NodeId, Item, torch.Tensor]] = field(default_factory=list)


class HopServer(KVHandoffs):
    def __init__(self, transport: Transport, is_member: Callable[[NodeId], bool], *, device: str = "cpu",
                 dtype: str = "float32", engine_config: EngineConfig | None = None,
                 pace_factory: PaceFactory | None = None, kv_transfer: KVTransferPolicy | None = None,
                 batch_policy: Callable[[KVLedger, BatchConfig], BatchPolicy] = BatchPolicy,
                 prefill_tokens: int | None = None) -> None:
        self.transport = transport
        self.batch_policy = batch_policy  # the shared one, or another design's (Splitwise's machine-level)
        # Prompt tokens a step batches while this node serves a prefill replica (role_batching.py); None: none.
        self.prefill_tokens = prefill_tokens
        self.device = device
        self.dtype = dtype
        self.engine_config = engine_config
        self.pace_factory = pace_factory
        self.mailbox = Mailbox(transport, INFER_PROTOCOL, infer_decoder, self._on_message, is_member)
        self.outbox = Outbox(self.mailbox, self._send_failed)
        # KV hand-offs on their own streams and queues: a large transfer never holds up activations or tokens.
        self.kv_mailbox = Mailbox(transport, KV_PROTOCOL, kv_decoder, self._on_kv, is_member)
        self.kv_outbox = Outbox(self.kv_mailbox, self._send_failed)
        self.kv_transfer = kv_transfer or KVTransferPolicy()  # whole after the step, or layer-wise within it
        # The measured bandwidth to a peer in Mbit/s, None where not measured (set by NodeDaemon from its probes).
        self.link_mbps: Callable[[NodeId], float | None] = lambda peer: None
        self.kv_bytes_sent = 0
        self.kv_bytes_received = 0
        self.kv_frames_sent = 0
        self.codec_rates: list[CodecRate] = []  # measured when the first shard loads
        # Who may install sessions here: the coordinator the node joined (set by NodeDaemon); nobody until then.
        self.is_coordinator: Callable[[NodeId], bool] = lambda peer: False
        self.assignment: Assignment | None = None
        self.engine: TorchEngine | None = None
        self.loop: BatchLoop | None = None
        self.sessions: dict[SessionId, HopSession] = {}
        self.leases_expired = 0
        self.metrics = NodeMetrics()
        self.metrics.view = lambda: NodeView(self.load(), {}, None, {})  # NodeDaemon adds its links and plan
        # Reports of the sessions that ended here, for the next heartbeat (the oldest go first when it is late).
        self.reports: deque[HopReport] = deque(maxlen=MAX_HOP_REPORTS)
        self._released: OrderedDict[SessionId, None] = OrderedDict()
        self._handed: OrderedDict[SessionId, NodeId] = OrderedDict()  # session -> its coordinator
        self._parked: dict[SessionId, _Parked] = {}
        self._parked_bytes = 0
        self._loop_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._assign_lock = trio.Lock()
        self._gone = trio.Event()  # set whenever a session goes (a draining node or a retiring shard waits)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            await nursery.start(self.outbox.run)
            await nursery.start(self.kv_outbox.run)
            self.mailbox.install()
            self.kv_mailbox.install()
            nursery.start_soon(self._expire)
            task_status.started()
            await trio.sleep_forever()

    def load(self) -> Load:
        if self.loop is None:
            return Load(leases_expired=self.leases_expired)
        kv = self.loop.kv
        # The block size turns the block counts into the pool's size in tokens, which the coordinator's scheduler
        # uses instead of its planner's estimate (requests too large for the real pool are refused).
        return Load(queued_tokens=max(0, self.loop.queued_tokens), active_sessions=kv.sessions,
                    kv_blocks_used=kv.used_blocks, kv_blocks_free=kv.free_blocks, kv_block_size=kv.block_size,
                    leases_expired=self.leases_expired, tokens_per_s=self.loop.rate.value,
                    prefill_tokens_per_s=self.loop.prefill_rate.value,
                    kv_codec_rates=self.codec_rates)

    # -- assignments -------------------------------------------------------------------------------------

    def start_assign(self, a: Assignment, report: ReportStatus) -> None:
        """Apply an assignment in the background (loading takes seconds; the control stream goes on)."""
        assert self._nursery is not None, "run() first"
        self._nursery.start_soon(self.assign, a, report)

    async def assign(self, a: Assignment, report: ReportStatus) -> None:
        """Serve `a`: (re)load the shard if it changed, then report ready or failed."""
        async with self._assign_lock:
            current = self.assignment  # what the engine serves
            same = (current is not None and self.engine is not None and current.model == a.model
                    and not reloads((current.first_layer, current.last_layer), (a.first_layer, a.last_layer)))
            if same or a.role == "idle":
                self.assignment = a
                if same and self.loop is not None:  # a phase flip keeps the layers; the step setting follows
                    self.loop.policy.set_prompt_tokens(self._prompt_tokens(a))
                # Ready first: that is the coordinator's cue to move the sessions still on the old shard away
                # with their KV, which the shard keeps until they have gone.
                await report(AssignmentStatus(plan_version=a.plan_version, state="ready"))
                if a.role == "idle":
                    await self._unload(f"this node is idle under plan {a.plan_version}")
                return
            await report(AssignmentStatus(plan_version=a.plan_version, state="loading"))
            reason = f"shard replaced by layers [{a.first_layer}, {a.last_layer}) for plan {a.plan_version}"
            try:
                try:
                    engine = await trio.to_thread.run_sync(self._load_engine, a)
                except (MemoryError, torch.OutOfMemoryError):
                    if self.engine is None:
                        raise
                    log.info("layers [%d, %d) do not fit beside the old shard; dropping it first",
                             a.first_layer, a.last_layer)
                    await self._unload(reason, drain=False)
                    engine = await trio.to_thread.run_sync(self._load_engine, a)
            except (HetnodeError, OSError, ValueError, RuntimeError, MemoryError) as exc:
                # The old shard (if any) stays: the sessions on it can still finish.
                log.error("loading layers [%d, %d) of %s failed: %s", a.first_layer, a.last_layer, a.model, exc)
                await report(AssignmentStatus(plan_version=a.plan_version, state="failed", detail=str(exc)))
                return
            loop = BatchLoop(engine, deliver=self._deliver, fail=self._fail,
                             pace=self.pace_factory(engine) if self.pace_factory else None,
                             layer_hook=self._stream_for, policy=self.batch_policy,
                             prompt_tokens=self._prompt_tokens(a))
            loop.on_step = lambda items, s: self.metrics.observe_step(
                len(items), sum(i.num_tokens for i in items), any(i.num_tokens > 1 for i in items), s)
            await loop.measure_prefill()
            old_engine, old_loop, old_scope = self.engine, self.loop, self._loop_scope
            self.assignment, self.engine, self.loop = a, engine, loop
            assert self._nursery is not None
            self._loop_scope = await self._nursery.start(self._run_loop, self.loop)
            log.info("serving layers [%d, %d) of %s (plan %d)", a.first_layer, a.last_layer, a.model,
                     a.plan_version)
            await report(AssignmentStatus(plan_version=a.plan_version, state="ready"))
            await self._retire(old_engine, old_loop, old_scope, reason)

    def _prompt_tokens(self, a: Assignment) -> int | None:
        """This node's prompt-token cap under `a`: its own --prefill-tokens for its role where it has one (an
        operator's say over its machine), else the one the coordinator's assignment names."""
        return prompt_tokens_for(a.role, self.prefill_tokens) if self.prefill_tokens is not None else a.prompt_tokens

    def _load_engine(self, a: Assignment) -> TorchEngine:
        engine = TorchEngine.load(a.model, a.first_layer, a.last_layer, device=self.device, dtype=self.dtype,
                                  engine_config=self.engine_config)
        if not self.codec_rates:  # once per node: the CPU, not the shard, sets the rates
            rates = codec_rates.measure(engine.config.num_kv_heads, engine.config.head_dim)
            self.codec_rates = [CodecRate(name, pack, unpack) for name, (pack, unpack) in rates.items()]
        return engine

    async def _run_loop(self, loop: BatchLoop, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await loop.run()

    async def _unload(self, reason: str, *, drain: bool = True) -> None:
        engine, loop, scope = self.engine, self.loop, self._loop_scope
        self.engine, self.loop, self._loop_scope = None, None, None
        await self._retire(engine, loop, scope, reason, drain=drain)

    async def _retire(self, engine: TorchEngine | None, loop: BatchLoop | None, scope: trio.CancelScope | None,
                      reason: str, *, drain: bool = True) -> None:
        """Stop a shard that is no longer current. With `drain`, it first serves on until its sessions have gone
        (the coordinator moves them with their KV once this node reports ready for the new plan; a prefill
        phase's sessions finish sending theirs), for a bounded time; its step under way finishes, and the
        sessions still on it then fail (their requests re-prefill elsewhere)."""
        if loop is not None and drain:
            with trio.move_on_after(_RETIRE_DRAIN_S):
                while any(s.loop is loop for s in self.sessions.values()):
                    await self._gone.wait()
        if loop is not None:
            # Bounded: a step is seconds at most; a loop stuck past that is cancelled, its work lost.
            with trio.move_on_after(_RETIRE_TIMEOUT_S):
                await loop.stop(reason)
            for session in [s for s in self.sessions.values() if s.loop is loop]:
                self._fail_session(session, reason)
        if scope is not None:
            scope.cancel()
        if engine is not None:
            await trio.to_thread.run_sync(engine.close)

    # -- messages ----------------------------------------------------------------------------------------

    async def _on_message(self, peer: NodeId, msg: object, payload: bytes | None) -> None:
        if isinstance(msg, Items):
            await self._on_items(peer, msg, payload)
        elif isinstance(msg, Install):
            await self._on_install(peer, msg)
        elif isinstance(msg, Release):
            session = self.sessions.get(SessionId(msg.session))
            if session is not None and session.coordinator != peer:
                self._refuse(peer, "not_yours", f"only the installing coordinator releases session {msg.session}")
            elif session is not None or self.is_coordinator(peer):
                # The coordinator may release a session whose Install never got here (refused, or lost): its
                # late items are then dropped. Anyone else's release of an unknown session changes nothing.
                self._drop(SessionId(msg.session))
        elif isinstance(msg, Reserve):
            self._on_reserve(peer, msg)
        elif isinstance(msg, SendKV):
            self._on_send_kv(peer, msg)
        elif isinstance(msg, Freeze):
            self._on_freeze(peer, msg)
        elif isinstance(msg, Export):
            await self._on_export(peer, msg)
        elif isinstance(msg, Renew):
            now = trio.current_time()
            for sid in msg.sessions:
                session = self.sessions.get(SessionId(sid))
                if session is not None and session.coordinator == peer:
                    session.deadline = now + session.lease_s
        else:
            raise ProtocolError(f"{type(msg).__name__} is not sent to a hop")

    def _refuse(self, peer: NodeId, code: str, message: str) -> None:
        log.warning("refused from %s: %s", peer, message)
        self.outbox.post(peer, ErrorReply(code=code, message=message))

    async def _on_install(self, peer: NodeId, msg: Install) -> None:
        sid = SessionId(msg.session)
        if not self.is_coordinator(peer):
            self._refuse(peer, "not_coordinator", "only the coordinator installs sessions")
            return
        if sid in self.sessions or sid in self._released:
            self._refuse(peer, "session_exists", f"session {sid} exists here already")
            return
        problem = ""
        engine, loop = self.engine, self.loop
        places = places_of(msg.route, self.transport.peer_id)
        if msg.adopts is not None:
            # The first phase hands over a frozen session's KV (Export); this hop serves only the last.
            places = [p for p in places if p.phase == len(msg.route.phases) - 1]
        if engine is None or loop is None:
            problem = "this node holds no layers (plan changing)"
        elif problem := route_problem(msg.route, engine.config.num_layers):
            pass
        elif msg.adopts is not None and len(msg.route.phases) != 2:
            problem = "a session that adopts another's KV has two phases: its hops, then the new ones"
        elif msg.kv_queued and (msg.adopts is not None or not queues_kv(msg.route)):
            problem = "only a prefill of the whole context, then a decode phase, keeps its KV queued"
        elif len(places) != 1:
            problem = "this node is not on the route" if not places else "this node is on the route twice"
        else:
            hop = msg.route.phases[places[0].phase].hops[places[0].hop]
            if (hop.first_layer, hop.last_layer) != (engine.first_layer, engine.last_layer):
                problem = (f"the route asks for layers [{hop.first_layer}, {hop.last_layer}) but this node holds "
                           f"[{engine.first_layer}, {engine.last_layer}) (plan changed)")
        if problem:
            self._unpark(sid)
            self._report(peer, sid, problem)
            return
        assert loop is not None
        place = places[0]
        route = msg.route
        hop = route.phases[place.phase].hops[place.hop]
        start, end = phase_span(route, place.phase, msg.prefill_end)
        session = HopSession(
            id=sid, coordinator=peer, route=route, place=place, sampling=sampling_params(msg.sampling),
            prefill_end=msg.prefill_end, max_tokens=msg.max_tokens, lease_s=msg.lease_s, loop=loop,
            deadline=trio.current_time() + msg.lease_s, next_start=start, span_end=end, kv_sent=start,
            kv_to=kv_targets(route, place.phase, hop), trace=msg.trace, kv_queued=msg.kv_queued)
        if start > 0:
            # This phase starts from the previous one's KV: hold the memory for it before any of it is sent (the
            # coordinator waits for Ready: before the prefill, or with kv_queued once the hand-off may start), so a
            # transfer never fails half-way for want of memory.
            session.kv_end = start
            for source in kv_sources(route, place.phase, hop):
                for layer in range(source.first_layer, source.last_layer):
                    session.kv_next[layer] = 0
                    session.kv_from[layer] = NodeId(source.peer)
            # A decode phase after a whole prefill continues the stream from the first token, sampled there.
            session.generated = 1 if start == msg.prefill_end else 0
        if start > 0 and not msg.kv_queued:  # (queued: it reserves on the coordinator's Reserve)
            if not await loop.reserve(sid, start):
                self._unpark(sid)
                self._report(peer, sid, f"no KV memory free here for the {start} tokens handed over", cause="full")
                return
            if self.loop is not loop or sid in self.sessions or sid in self._released:
                # The shard changed or the session was released while the memory was reserved.
                loop.release(sid)
                self._unpark(sid)
                self._report(peer, sid, "the session changed while its KV was reserved")
                return
            session.kv_reserved = True
        parked = self._unpark(sid)
        self.sessions[sid] = session
        log.debug("session %s (trace %s) installed: phase %d hop %d", sid, msg.trace or "-", place.phase, place.hop)
        if session.kv_reserved:
            self.outbox.post(peer, Ready(session=sid))
        by_sender: dict[NodeId, list[Work]] = {}
        for sender, item, rows in parked.items if parked else []:
            work = self._admit(sender, session, item, rows)
            if work is not None:
                by_sender.setdefault(sender, []).append(work)
        for sender, works in by_sender.items():
            await self._submit(sender, works)

    async def _on_items(self, peer: NodeId, msg: Items, payload: bytes | None) -> None:
        if payload is None:
            raise ProtocolError("Items without a tensor")
        tensor = from_wire(msg.tensor, payload)
        rows = sum(it.count for it in msg.items)
        if tensor.dim() < 1 or tensor.shape[0] != rows:
            raise ProtocolError(f"Items of {rows} positions with a tensor of shape {list(tensor.shape)}")
        engine = self.engine
        if engine is not None:
            want = "1-d int64 token ids" if engine.is_first else f"[n, {engine.config.hidden_size}] hidden states"
            ok = (tensor.dim() == 1 and msg.tensor.dtype == "int64") if engine.is_first else (
                tensor.dim() == 2 and tensor.shape[1] == engine.config.hidden_size and tensor.is_floating_point())
            if not ok:
                raise ProtocolError(f"this hop takes {want}, not {msg.tensor.dtype}{list(tensor.shape)}")
        offset = 0
        works: list[Work] = []
        for item in msg.items:
            part = tensor[offset:offset + item.count]
            offset += item.count
            sid = SessionId(item.session)
            session = self.sessions.get(sid)
            if session is not None:
                work = self._admit(peer, session, item, part)
                if work is not None:
                    works.append(work)
            elif sid not in self._released:
                self._park(peer, sid, item, part)
        await self._submit(peer, works)

    def _park(self, peer: NodeId, sid: SessionId, item: Item, rows: torch.Tensor) -> None:
        parked = self._parked.get(sid)
        size = rows.numel() * rows.element_size()
        full = len(self._parked) >= _PARK_SESSIONS if parked is None else len(parked.items) >= _PARK_ITEMS
        if full or self._parked_bytes + size > _PARK_BYTES:
            self._refuse(peer, "unknown_session", f"session {sid} is not installed here")
            return
        if parked is None:
            parked = self._parked[sid] = _Parked(trio.current_time())
        parked.items.append((peer, item, rows.clone()))
        self._parked_bytes += size

    def _unpark(self, sid: SessionId) -> _Parked | None:
        parked = self._parked.pop(sid, None)
        if parked is not None:
            self._parked_bytes -= sum(rows.numel() * rows.element_size() for _, _, rows in parked.items)
        return parked

    def _admit(self, peer: NodeId, session: HopSession, item: Item, rows: torch.Tensor) -> Work | None:
        """The batch-loop work for `item`, or None (with an error reply to the sender) when `peer` may not send
        it or it does not continue the session where it stands."""
        if session.frozen:
            return None  # in flight when it froze: the session goes on elsewhere from its KV
        problem = session.sender_problem(peer, item)
        if not problem and item.start != session.next_start:
            problem = f"session {session.id} stands at position {session.next_start}, not {item.start}"
        if problem:
            self._refuse(peer, "refused", problem)  # the session itself is untouched
            return None
        session.next_start = item.start + item.count
        end = item.start + item.count
        sampling = session.sampling if session.is_last and Lifecycle.samples(end, session.prefill_end) else None
        engine = self.engine
        if rows.dtype == torch.int64:
            step_item = StepItem(session.id, item.start, token_ids=rows.tolist(), sampling=sampling)
        else:
            dtype = engine.dtype if engine is not None else rows.dtype
            step_item = StepItem(session.id, item.start, hidden=rows.to(dtype), sampling=sampling)
        # The Install says how long the context is: a hop's first item reserves KV for all of it, even where it
        # sees the prompt only in pieces.
        return Work(step_item, session, prefill_end=session.prefill_end)

    async def _submit(self, peer: NodeId, works: list[Work]) -> None:
        """Hand a message's items to their batch loops, all at once (one step takes them together); items of a
        session still waiting for handed-over KV wait with it."""
        by_loop: dict[int, list[Work]] = {}
        for work in works:
            if work.ctx.kv_waiting:
                work.ctx.held.append((peer, work))
                continue
            by_loop.setdefault(id(work.ctx.loop), []).append(work)
        for group in by_loop.values():
            loop = group[0].ctx.loop
            try:
                if peer != self.transport.peer_id:
                    await loop.submit_all(group)  # a full queue pushes back on the sender's stream
                    continue
                for work in group:
                    if not loop.submit_nowait(work):
                        # Our own decode token, from inside the loop's delivery: waiting on the loop would
                        # deadlock it.
                        self._fail_session(work.ctx, "this node's batch queue is full")
            except trio.ClosedResourceError:
                for work in group:
                    if self.sessions.get(work.ctx.id) is work.ctx:
                        self._fail_session(work.ctx, "shard replaced while the item waited (plan changed)")

    # -- results -----------------------------------------------------------------------------------------

    async def _deliver(self, done: Sequence[tuple[Work, ItemResult]]) -> None:
        onward: dict[NodeId, tuple[list[Item], list[torch.Tensor], list[HopSession]]] = {}
        tokens: dict[NodeId, list[Token]] = {}
        handing: list[tuple[HopSession, int]] = []  # sessions whose KV up to a position goes to the next phase
        for work, result in done:
            session: HopSession = work.ctx
            if self.sessions.get(session.id) is not session:
                continue  # released or failed while the step ran
            item = work.item
            end = item.start + item.num_tokens
            session.computed = max(session.computed, end)
            session.stats.step(item.num_tokens, session.loop.last_step_s, trio.current_time())
            if session.frozen:
                continue  # its results would race the move: the session goes on from its KV elsewhere
            if session.kv_to and not session.kv_queued:  # (queued: the KV stays here until SendKV)
                handing.append((session, end))
            if not session.is_last:
                assert result.hidden is not None
                nxt = NodeId(session.phase.hops[session.hop + 1].peer)
                _add(onward, nxt, Item(session.id, item.start, item.num_tokens), result.hidden, session)
                continue
            if result.token is None:
                continue  # a prefill chunk that does not sample
            session.generated += 1
            then = Lifecycle.after_token(session.phase.kind, session.generated, session.max_tokens, result.stopped)
            last = then == "end"
            tokens.setdefault(session.coordinator, []).append(Token(
                session=session.id, position=end, token=result.token, logprob=result.logprob,
                top_logprobs=list(result.top_logprobs) if result.top_logprobs else None, stopped=result.stopped,
                last=last))
            if then == "loop":
                first = NodeId(session.phase.hops[0].peer)
                _add(onward, first, Item(session.id, end, 1), torch.tensor([result.token]), session)
            elif then == "handoff":  # the first token starts the next phase, which decodes on the handed KV
                first = NodeId(session.route.phases[session.place.phase + 1].hops[0].peer)
                _add(onward, first, Item(session.id, end, 1), torch.tensor([result.token]), session)
        for coordinator, toks in tokens.items():
            if not self.outbox.post(coordinator, Tokens(tokens=toks)):
                for t in toks:
                    self._fail_local(SessionId(t.session), "could not queue the tokens for the coordinator")
        for peer, (items, parts, sessions) in onward.items():
            if peer == self.transport.peer_id:
                # A one-hop phase feeds its own loop: straight back into the queue, never over the network.
                admitted = [self._admit(peer, session, it, part)
                            for it, part, session in zip(items, parts, sessions, strict=True)]
                await self._submit(peer, [w for w in admitted if w is not None])
                continue
            meta, raw = to_wire(torch.cat(parts))
            if not self.outbox.post(peer, Items(items=items, tensor=meta), raw):
                for session in sessions:
                    self._fail_session(session, f"could not queue the results for {peer}", unreachable=peer)
        if handing:  # after the tokens and activations: the first token never waits for the KV
            await self._hand_off(handing)

    async def _fail(self, work: Work, reason: str, cause: Cause) -> None:
        session: HopSession = work.ctx
        if self.sessions.get(session.id) is session:
            self._fail_session(session, reason, cause=cause)

    async def _send_failed(self, peer: NodeId, msg: object, reason: str) -> None:
        """The outbox could not deliver `msg` to `peer`: fail the sessions it carried."""
        if isinstance(msg, Items | KV):
            for sid in {SessionId(it.session) for it in (msg.items if isinstance(msg, Items) else [msg])}:
                session = self.sessions.get(sid)
                why = f"could not pass the {'KV' if isinstance(msg, KV) else 'result'} on: {reason}"
                if session is not None:
                    self._fail_session(session, why, unreachable=peer)
                elif sid in self._handed:  # handed over and freed here: its coordinator still must hear
                    self._report(self._handed.pop(sid), sid, why, unreachable=peer)
        elif isinstance(msg, Tokens):
            for t in msg.tokens:
                self._drop(SessionId(t.session))  # its coordinator is gone: nobody to report to

    def _fail_session(self, session: HopSession, reason: str, unreachable: NodeId | None = None,
                      cause: Cause = "lost") -> None:
        log.warning("session %s (trace %s) failed here: %s", session.id, session.trace or "-", reason)
        self._drop(session.id, "failed")
        self._report(session.coordinator, session.id, reason, unreachable, cause)

    def _fail_local(self, sid: SessionId, reason: str) -> None:
        session = self.sessions.get(sid)
        if session is not None:
            self._fail_session(session, reason)

    def _report(self, coordinator: NodeId, sid: SessionId, reason: str, unreachable: NodeId | None = None,
                cause: Cause = "lost") -> None:
        self.outbox.post(coordinator, Failed(session=sid, hop_peer=self.transport.peer_id, reason=reason,
                                             unreachable=unreachable or "", cause=cause))

    def _drop(self, sid: SessionId, end: str = "released") -> None:
        """Forget the session and free its KV (released, failed, expired or handed over)."""
        session = self.sessions.pop(sid, None)
        if session is not None:
            self.metrics.sessions_ended.labels(end).inc()
            self.reports.append(session.stats.report(session.id, session.trace, session.place.phase,
                                                     session.place.hop, end))
        self._unpark(sid)
        self._released[sid] = None
        if len(self._released) > _RELEASED_MEMORY:
            self._released.popitem(last=False)
        if session is not None:
            session.loop.release(sid)
        self._gone.set()
        self._gone = trio.Event()

    async def drain(self, timeout_s: float) -> bool:
        """Until this hop serves no session (they moved away or ended), at most `timeout_s`; True if none is left."""
        with trio.move_on_after(timeout_s):
            while self.sessions:
                await self._gone.wait()
        return not self.sessions

    def take_reports(self) -> list[HopReport]:
        """The reports of the sessions that ended here since the last call (for a heartbeat)."""
        out = list(self.reports)
        self.reports.clear()
        return out

    # -- leases ------------------------------------------------------------------------------------------

    async def _expire(self) -> None:
        """Free sessions whose coordinator went silent, and refuse items whose Install never came."""
        while True:
            await trio.sleep(1.0)
            now = trio.current_time()
            for session in [s for s in self.sessions.values() if s.deadline < now]:
                self.leases_expired += 1
                log.warning("session %s: no word from its coordinator %s for %.0f s; its lease expired, KV freed",
                            session.id, session.coordinator, session.lease_s)
                self._drop(session.id, "expired")
            for sid in [sid for sid, p in self._parked.items() if now - p.since > _PARK_S]:
                parked = self._unpark(sid)
                assert parked is not None
                for peer in {peer for peer, _, _ in parked.items}:
                    self._refuse(peer, "unknown_session", f"session {sid} was never installed here")


def _add(onward: dict[NodeId, tuple[list[Item], list[torch.Tensor], list[HopSession]]], peer: NodeId, item: Item,
         part: torch.Tensor, session: HopSession) -> None:
    items, parts, sessions = onward.setdefault(peer, ([], [], []))
    items.append(item)
    parts.append(part)
    sessions.append(session)
