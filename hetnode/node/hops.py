"""A node's part of the data path: hold the assigned layers, run what arrives, pass the result on.

An Assignment names a model and a layer range; the node loads only that shard (in the worker thread) and
reports ready. A new layer range is loaded beside the old shard, which goes on serving the old plan's requests
meanwhile (many finish on it); then the new shard takes over and the old one's queued work gets StageFailed
("shard replaced"), so those requests move to the new plan at once instead of waiting out a timeout. Only when
both shards do not fit is the old one dropped first.

Forward messages become batch-loop work; after a step, a middle stage streams each item's hidden states to the
next stage of that item's own route, and the last stage returns the sampled token (or ChunkDone for a prefill
chunk that does not sample) to the coordinator. Anything that cannot run gets a StageFailed back to the
coordinator with the reason; Release frees a session's KV.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

import torch
import trio

from hetnode.errors import HetnodeError
from hetnode.ids import NodeId, SessionId
from hetnode.node.batcher import BatchLoop, Pace, Work
from hetnode.node.engine import EngineConfig, ItemResult, SamplingParams, StepItem, TorchEngine
from hetnode.protocol.mailbox import Mailbox
from hetnode.protocol.messages import (
    INFER_PROTOCOL,
    Assignment,
    AssignmentStatus,
    ChunkDone,
    Forward,
    Load,
    Release,
    Sampling,
    StageFailed,
    TokenOut,
    infer_decoder,
)
from hetnode.protocol.tensors import from_wire, to_wire
from hetnode.protocol.transport import Transport

log = logging.getLogger(__name__)

ReportStatus = Callable[[AssignmentStatus], Awaitable[None]]
PaceFactory = Callable[[TorchEngine], Pace | None]
_RETIRE_TIMEOUT_S = 30.0


def sampling_params(s: Sampling) -> SamplingParams:
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                          stop_token_ids=tuple(s.stop_token_ids), logprobs=s.logprobs)


class StageServer:
    def __init__(self, transport: Transport, is_member: Callable[[NodeId], bool], *, device: str = "cpu",
                 dtype: str = "float32", engine_config: EngineConfig | None = None,
                 pace_factory: PaceFactory | None = None) -> None:
        self.transport = transport
        self.device = device
        self.dtype = dtype
        self.engine_config = engine_config
        self.pace_factory = pace_factory
        self.mailbox = Mailbox(transport, INFER_PROTOCOL, infer_decoder, self._on_message, is_member)
        self.assignment: Assignment | None = None
        self.engine: TorchEngine | None = None
        self.loop: BatchLoop | None = None
        self._loop_scope: trio.CancelScope | None = None
        self._nursery: trio.Nursery | None = None
        self._assign_lock = trio.Lock()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self.mailbox.install()
            task_status.started()
            await trio.sleep_forever()

    def load(self) -> Load:
        if self.loop is None:
            return Load()
        kv = self.loop.kv
        return Load(queued_tokens=max(0, self.loop.queued_tokens), active_sessions=kv.sessions,
                    kv_blocks_used=kv.used_blocks, kv_blocks_free=kv.free_blocks)

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
                    and (current.first_layer, current.last_layer) == (a.first_layer, a.last_layer))
            if same or a.role == "idle":
                self.assignment = a
                if a.role == "idle":
                    await self._unload(f"this node is idle under plan {a.plan_version}")
                await report(AssignmentStatus(plan_version=a.plan_version, state="ready"))
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
                    await self._unload(reason)
                    engine = await trio.to_thread.run_sync(self._load_engine, a)
            except (HetnodeError, OSError, ValueError, RuntimeError, MemoryError) as exc:
                # The old shard (if any) stays: the old plan's requests on it can still finish.
                log.error("loading layers [%d, %d) of %s failed: %s", a.first_layer, a.last_layer, a.model, exc)
                await report(AssignmentStatus(plan_version=a.plan_version, state="failed", detail=str(exc)))
                return
            old_engine, old_loop, old_scope = self.engine, self.loop, self._loop_scope
            self.assignment, self.engine = a, engine
            self.loop = BatchLoop(engine, deliver=self._deliver, fail=self._fail,
                                  pace=self.pace_factory(engine) if self.pace_factory else None)
            assert self._nursery is not None
            self._loop_scope = await self._nursery.start(self._run_loop, self.loop)
            log.info("serving layers [%d, %d) of %s (plan %d)", a.first_layer, a.last_layer, a.model,
                     a.plan_version)
            await report(AssignmentStatus(plan_version=a.plan_version, state="ready"))
            await self._retire(old_engine, old_loop, old_scope, reason)

    def _load_engine(self, a: Assignment) -> TorchEngine:
        return TorchEngine.load(a.model, a.first_layer, a.last_layer, device=self.device, dtype=self.dtype,
                                engine_config=self.engine_config)

    async def _run_loop(self, loop: BatchLoop, *, task_status: trio.TaskStatus[trio.CancelScope]) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await loop.run()

    async def _unload(self, reason: str) -> None:
        engine, loop, scope = self.engine, self.loop, self._loop_scope
        self.engine, self.loop, self._loop_scope = None, None, None
        await self._retire(engine, loop, scope, reason)

    async def _retire(self, engine: TorchEngine | None, loop: BatchLoop | None, scope: trio.CancelScope | None,
                      reason: str) -> None:
        """Stop a shard that is no longer current: its step under way finishes, its queued work fails."""
        if loop is not None:
            # Bounded: a step is seconds at most; a loop stuck past that is cancelled, its work lost.
            with trio.move_on_after(_RETIRE_TIMEOUT_S):
                await loop.stop(reason)
        if scope is not None:
            scope.cancel()
        if engine is not None:
            await trio.to_thread.run_sync(engine.close)

    # -- messages ----------------------------------------------------------------------------------------

    async def _on_message(self, peer: NodeId, msg: object, payload: bytes | None) -> None:
        if isinstance(msg, Forward):
            await self._on_forward(peer, msg, payload)
        elif isinstance(msg, Release):
            if self.loop is not None:
                self.loop.release(SessionId(msg.session))
        else:
            log.warning("unexpected %s on the data path from %s", type(msg).__name__, peer)

    async def _on_forward(self, peer: NodeId, fwd: Forward, payload: bytes | None) -> None:
        engine, loop = self.engine, self.loop
        here = fwd.route[fwd.stage] if fwd.stage < len(fwd.route) else None
        problem = ""
        if here is None or NodeId(here.peer) != self.transport.peer_id:
            problem = "this node is not that stage of the route"
        elif engine is None or loop is None:
            problem = "this node holds no layers (plan changing)"
        elif (here.first_layer, here.last_layer) != (engine.first_layer, engine.last_layer):
            problem = (f"route asks for layers [{here.first_layer}, {here.last_layer}) but this node holds "
                       f"[{engine.first_layer}, {engine.last_layer}) (plan changed)")
        if problem or payload is None:
            await self._report_failure(fwd, problem or "forward without a tensor")
            return
        assert engine is not None and loop is not None
        try:
            tensor = from_wire(fwd.tensor, payload)
        except HetnodeError as exc:
            await self._report_failure(fwd, str(exc))
            return
        sampling = sampling_params(fwd.sampling) if fwd.sampling is not None else None
        session = SessionId(fwd.session)
        if engine.is_first:
            if fwd.tensor.dtype != "int64" or tensor.dim() != 1:
                await self._report_failure(fwd, "the first stage takes a 1-d int64 tensor of token ids")
                return
            item = StepItem(session, fwd.start, token_ids=tensor.tolist(), sampling=sampling)
        else:
            item = StepItem(session, fwd.start, hidden=tensor.to(engine.dtype), sampling=sampling)
        try:
            await loop.submit(Work(item, fwd))
        except trio.ClosedResourceError:
            await self._report_failure(fwd, "shard replaced while the item waited (plan changed)")

    async def _deliver(self, done: Sequence[tuple[Work, ItemResult]]) -> None:
        for work, result in done:
            fwd: Forward = work.ctx
            try:
                if fwd.stage + 1 < len(fwd.route):
                    assert result.hidden is not None
                    meta, raw = to_wire(result.hidden)
                    nxt = fwd.route[fwd.stage + 1]
                    await self.mailbox.send(NodeId(nxt.peer), Forward(
                        session=fwd.session, start=fwd.start, route=fwd.route, stage=fwd.stage + 1,
                        reply_to=fwd.reply_to, sampling=fwd.sampling, tensor=meta), raw)
                elif result.token is None:
                    await self.mailbox.send(NodeId(fwd.reply_to), ChunkDone(session=fwd.session, start=fwd.start))
                else:
                    await self.mailbox.send(NodeId(fwd.reply_to), TokenOut(
                        session=fwd.session, start=fwd.start, token=result.token, logprob=result.logprob,
                        top_logprobs=list(result.top_logprobs) if result.top_logprobs else None,
                        stopped=result.stopped))
            except HetnodeError as exc:
                nxt_peer = fwd.route[fwd.stage + 1].peer if fwd.stage + 1 < len(fwd.route) else fwd.reply_to
                await self._report_failure(fwd, f"could not pass the result on: {exc}", unreachable=nxt_peer)

    async def _fail(self, work: Work, reason: str) -> None:
        await self._report_failure(work.ctx, reason)

    async def _report_failure(self, fwd: Forward, reason: str, unreachable: str = "") -> None:
        log.warning("session %s at position %d failed here: %s", fwd.session, fwd.start, reason)
        if self.loop is not None:
            self.loop.release(SessionId(fwd.session))
        try:
            await self.mailbox.send(NodeId(fwd.reply_to), StageFailed(
                session=fwd.session, start=fwd.start, stage_peer=self.transport.peer_id, reason=reason,
                unreachable=unreachable))
        except HetnodeError as exc:
            log.warning("could not report the failure to %s: %s", fwd.reply_to, exc)
