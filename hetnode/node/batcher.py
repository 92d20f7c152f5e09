"""The dynamic batch loop around one engine (Helix §5.1): each step takes all work that arrived meanwhile.

Work arrives on a bounded channel, so a full node pushes back on its senders instead of growing a queue. The
loop waits for the first item, then drains whatever else is already queued (never waiting for more), and lets
the batch policy (`hetnode.policy.BatchPolicy`, the same object the simulator runs) pick the step: the token
budget, one item per session, chunked prefill, and KV admission against a ledger as large as the engine's pool.
Work whose KV does not fit waits in the queue; the engine never sees more than the ledger reserved, so a step
cannot fail for KV memory. A prompt chunk the policy splits runs as pieces, each delivered as it completes
(sampling only on the last). The step runs in the device's worker thread (CapacityLimiter(1): the engine is not
thread-safe); an owner's `layer_hook`, asked before each step, may give it a hook the engine calls after each
layer there (the hop server streams KV from it, layer by layer). Results go to `deliver`; items that cannot run
go to `fail` with a reason: a prompt larger than the whole pool, a session the policy preempted (out of KV with
nothing else able to run), an `EngineError`. `stop` ends the loop without stranding anyone: the step under way
completes and delivers, and every item still queued goes to `fail`, so its requester hears about it instead of
waiting for an answer that never comes.

The node's hop server and the single-process `LocalGenerator` both drive an engine through this loop.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import trio

from hetnode.ids import SessionId
from hetnode.kv import KVUsage
from hetnode.kv.blocks import KVCacheFull
from hetnode.node.engine.base import Engine, EngineError, ItemResult, LayerDone, StepItem
from hetnode.policy import MIN_CHUNK, PREEMPTED, BatchConfig, BatchPolicy, Cause, KVLedger, StepRate
from hetnode.policy.reservation_queue import ReservationQueue

log = logging.getLogger(__name__)
T = TypeVar("T")

# Sessions released recently: work for them that is still in flight is dropped, not run.
_RELEASED_MEMORY = 65536
PREFILL_PROBE_TOKENS = 128  # the prompt a new shard is timed on: a typical chunk, and short next to a load


@dataclass(frozen=True, slots=True)
class Work:
    item: StepItem
    ctx: Any = None  # whatever the owner needs to route the result (reply address, next hop, ...)
    # Tokens the session prefills, so that its first item here reserves KV for the whole prompt; 0: the item's
    # own end (all a hop that sees only chunks knows; later chunks then grow the reservation).
    prefill_end: int = 0

    def __post_init__(self) -> None:
        if self.prefill_end <= 0:
            object.__setattr__(self, "prefill_end", self.item.start + self.item.num_tokens)


class _Queued:
    """A queued item as the batch policy reads it (`hetnode.policy.Pending`)."""

    __slots__ = ("num_tokens", "prefill_end", "session", "start", "work")

    def __init__(self, work: Work) -> None:
        self.work = work
        self.session = work.item.session
        self.start = work.item.start
        self.num_tokens = work.item.num_tokens
        self.prefill_end = work.prefill_end


def split_item(item: StepItem, k: int) -> tuple[StepItem, StepItem]:
    """The first `k` tokens of `item` (no sampling: it is not the end of the chunk) and the rest."""
    if item.token_ids is not None:
        ids = list(item.token_ids)
        return (StepItem(item.session, item.start, token_ids=ids[:k]),
                StepItem(item.session, item.start + k, token_ids=ids[k:], sampling=item.sampling))
    assert item.hidden is not None
    # hidden: [n, H] -> [k, H] and [n - k, H]
    return (StepItem(item.session, item.start, hidden=item.hidden[:k]),
            StepItem(item.session, item.start + k, hidden=item.hidden[k:], sampling=item.sampling))


Deliver = Callable[[list[tuple[Work, ItemResult]]], Awaitable[None]]
Fail = Callable[[Work, str, Cause], Awaitable[None]]  # the reason, and its cause for the lifecycle policy
Pace = Callable[[Sequence[StepItem]], float]
# Before each step, in the event loop: the step's `layer_done` hook for these works, or None (layer-wise KV).
LayerHook = Callable[[Sequence[Work]], LayerDone | None]


class _Waiter:
    """A reservation waiting for KV room (`BatchLoop.reserve_queued`): set when the queue grants it, or gives it
    up (released, the loop stopping)."""

    __slots__ = ("done", "granted")

    def __init__(self) -> None:
        self.granted = False
        self.done = trio.Event()


class BatchLoop:
    def __init__(self, engine: Engine, *, deliver: Deliver, fail: Fail, pace: Pace | None = None,
                 queue_size: int = 4096, min_chunk: int = MIN_CHUNK,
                 policy: Callable[[KVLedger, BatchConfig], BatchPolicy] = BatchPolicy,
                 layer_hook: LayerHook | None = None, max_prompts: int | None = None,
                 max_decodes: int | None = None, prompt_tokens: int | None = None) -> None:
        self.engine = engine
        self._deliver = deliver
        self._fail = fail
        self._pace = pace
        self._layer_hook = layer_hook
        # None wakes an idle loop so that a release frees KV at once rather than at the next step.
        self._send, self._recv = trio.open_memory_channel[Work | None](queue_size)
        self._limiter = trio.CapacityLimiter(1)
        self._deferred: list[_Queued] = []
        self._stalled = False  # everything queued waits for KV: wait for new work or a release
        self._releases: list[SessionId] = []  # asked for, not yet applied to the ledger
        self._engine_releases: list[SessionId] = []  # dropped from the ledger, to free in the engine first
        self._released: OrderedDict[SessionId, None] = OrderedDict()
        self.queued_tokens = 0
        self.steps = 0
        self.rate = StepRate()  # tokens/s of this loop's steps (heartbeats report it; SWARM's scheduler reads it)
        # tokens/s of the steps that prefill: what the coordinator weighs a re-prefill here against a KV hand-off by
        self.prefill_rate = StepRate()
        self.last_step_s = 0.0  # the duration of the step whose results `deliver` is handed
        self.on_step: Callable[[Sequence[StepItem], float], None] | None = None  # an owner's metrics
        self.kv = engine.kv_usage()
        self.ledger = KVLedger(self.kv.total_blocks, self.kv.block_size)
        # The batch policy (the simulator's nodes take the same factory): the shared one unless a design brings
        # its own.
        # The step caps (prompt and decode items per step, prompt tokens per step: a prefill replica's,
        # role_batching.py) are the policy's; none by default, as the engine's budget is in tokens. The simulator
        # passes the same ones to its nodes.
        self.policy = policy(self.ledger, BatchConfig(max_batch_tokens=engine.engine_config.max_batch_tokens,
                                                      min_chunk=min_chunk, max_prompts=max_prompts,
                                                      max_decodes=max_decodes, prompt_tokens=prompt_tokens))
        self._idle = trio.Event()
        self._busy = False
        self._stopping: str | None = None
        self._stopped = trio.Event()
        # Reservations that wait for KV room, first come first granted (`reserve_queued`; the simulator's decode
        # hops run the same queue), by session.
        self._reservations: ReservationQueue[SessionId] = ReservationQueue()
        self._waiters: dict[SessionId, _Waiter] = {}

    async def wait_idle(self) -> None:
        """Until nothing is queued, deferred or waiting to be released (tests and graceful shutdown)."""
        while not self._is_idle():
            idle = self._idle = trio.Event()
            await idle.wait()

    def _is_idle(self) -> bool:
        if self._stopped.is_set():
            return True
        return (not self._busy and not self._deferred and not self._releases and not self._engine_releases
                and self._recv.statistics().current_buffer_used == 0)

    # -- producers ---------------------------------------------------------------------------------------

    async def submit(self, work: Work) -> None:
        """Queue one item (waits while the queue is full); trio.ClosedResourceError once the loop is stopping."""
        self.queued_tokens += work.item.num_tokens
        try:
            await self._send.send(work)
        except trio.ClosedResourceError:
            self.queued_tokens -= work.item.num_tokens
            raise

    async def submit_all(self, works: Sequence[Work]) -> None:
        """Queue a message's items together, without a checkpoint between them: an idle loop that wakes on the
        first must find them all, or it would run a step of one item and leave the rest a whole step behind.
        Waits only while the queue is full; trio.ClosedResourceError once the loop is stopping."""
        for i, work in enumerate(works):
            if not self.submit_nowait(work):
                for rest in works[i:]:
                    await self.submit(rest)
                return
        await trio.lowlevel.checkpoint()

    def submit_nowait(self, work: Work) -> bool:
        """Queue one item without waiting (for the loop's own deliveries, which must never wait on the loop);
        False when the queue is full. trio.ClosedResourceError once the loop is stopping."""
        try:
            self._send.send_nowait(work)
        except trio.WouldBlock:
            return False
        self.queued_tokens += work.item.num_tokens
        return True

    async def reserve(self, session: SessionId, tokens: int) -> bool:
        """Hold KV for positions [0, tokens) of a new session whose values come from another node (a hand-off):
        in the ledger and in the engine, or in neither (False: no room now)."""
        if not self.ledger.reserve(session, tokens):
            return False
        return await self._reserve_engine(session, tokens)

    async def _reserve_engine(self, session: SessionId, tokens: int) -> bool:
        """The engine's side of a reservation the ledger has made (undone in the ledger when the engine fails)."""
        releases = self._take_releases()  # blocks the ledger already counts free must be free in the engine too
        try:
            await trio.to_thread.run_sync(self._reserve_sync, releases, session, tokens, limiter=self._limiter)
        except (KVCacheFull, EngineError) as exc:
            log.error("reserving %d tokens of KV for %s failed where the ledger had room: %s", tokens, session, exc)
            self.ledger.release(session)
            return False
        return True

    async def reserve_queued(self, session: SessionId, tokens: int) -> bool:
        """`reserve`, but waiting for room instead of failing (a hand-off booked when it starts, ThunderServe's
        KV queues): behind every reservation that waits already, until released KV lets it in. The sessions
        already running here keep growing meanwhile; only new hand-offs wait. False when the session is
        released while it waits, the loop stops, or the pool could never hold `tokens`."""
        if self._stopping is not None or self.ledger.blocks_for(tokens) > self.ledger.capacity:
            return False
        if not self._reservations.request(self.ledger, session, session, tokens):
            waiter = self._waiters[session] = _Waiter()
            await waiter.done.wait()
            if not waiter.granted or session in self._released:
                return False  # (released after its grant: the release frees the grant in the ledger)
        return await self._reserve_engine(session, tokens)

    @property
    def waiting_reservations(self) -> int:
        return len(self._reservations)

    def _grant(self) -> None:
        """Let in the waiting reservations at the head of the queue while the ledger has room for them (after
        every release, and before the next step's batch takes any of the room freed)."""
        for session in self._reservations.grant(self.ledger):
            waiter = self._waiters.pop(session)
            waiter.granted = True
            waiter.done.set()

    def _drop_waiter(self, session: SessionId) -> None:
        if self._reservations.drop(session):
            self._waiters.pop(session).done.set()

    def _reserve_sync(self, releases: list[SessionId], session: SessionId, tokens: int) -> None:
        self._release_sync(releases)
        self.engine.reserve_kv(session, tokens)
        self.kv = self.engine.kv_usage()

    async def measure_prefill(self, tokens: int = PREFILL_PROBE_TOKENS) -> float:
        """Time one prompt of `tokens` positions through this shard, paced like any step, and start the prefill
        rate from it; tokens/s, or 0 when the shard cannot hold it. A node that only decodes never runs a
        prompt, yet the coordinator weighs re-prefilling there against moving a prompt's KV to it. Call it
        before the loop takes work: a throwaway session that is freed at once."""
        engine = self.engine
        item = StepItem(session=SessionId("prefill-probe"), start=0,
                        token_ids=[0] * tokens if engine.is_first else None,
                        hidden=None if engine.is_first else torch.zeros(tokens, engine.config.hidden_size))

        def run(engine: Engine) -> None:
            try:
                engine.step([item])
            finally:
                engine.release(item.session)

        t0 = trio.current_time()
        try:
            await self.run_engine(run)
        except (EngineError, KVCacheFull) as exc:
            log.info("no prefill probe on this shard (%s): its prefill rate comes from its first prompts", exc)
            return 0.0
        if self._pace is not None:
            await trio.sleep_until(t0 + self._pace([item]))
        rate = tokens / max(trio.current_time() - t0, 1e-9)
        self.prefill_rate = StepRate(initial=rate, weight=self.prefill_rate.weight)
        return rate

    async def run_engine(self, fn: Callable[[Engine], T]) -> T:
        """`fn(engine)` in the worker thread, between steps (KV hand-offs read and write the engine's cache)."""
        return await trio.to_thread.run_sync(fn, self.engine, limiter=self._limiter)

    def release(self, session: SessionId) -> None:
        """Free the session's KV before the next step, and drop its work still queued."""
        self._drop_waiter(session)
        self._releases.append(session)
        self._released[session] = None
        if len(self._released) > _RELEASED_MEMORY:
            self._released.popitem(last=False)
        # A full queue means the loop is busy and sees the release before its next step anyway.
        with contextlib.suppress(trio.WouldBlock, trio.ClosedResourceError):
            self._send.send_nowait(None)

    # -- the loop ----------------------------------------------------------------------------------------

    async def stop(self, reason: str) -> None:
        """Take no more work, finish the step under way, fail what is still queued with `reason`; returns when
        the loop has ended."""
        if self._stopping is None:
            self._stopping = reason
            self._send.close()  # wakes an idle loop, and refuses later submits
        await self._stopped.wait()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while self._stopping is None:
                if self._is_idle():
                    self._idle.set()
                try:
                    batch = await self._next_batch()
                except trio.EndOfChannel:
                    break
                self._busy = True
                try:
                    await self._run_step(batch)
                finally:
                    self._busy = False
            await self._fail_pending(self._stopping or "the batch loop stopped")
        finally:
            self._reservations.clear()
            waiters, self._waiters = self._waiters, {}
            for waiter in waiters.values():
                waiter.done.set()
            self._stopped.set()
            self._idle.set()

    async def _fail_pending(self, reason: str) -> None:
        pending, self._deferred = [q.work for q in self._deferred], []
        while True:
            try:
                work = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if work is not None:
                self.queued_tokens -= work.item.num_tokens
                pending.append(work)
        for work in pending:
            if work.item.session not in self._released:
                await self._fail(work, reason, "lost")
        releases = self._take_releases()
        if releases:
            await trio.to_thread.run_sync(self._release_sync, releases, limiter=self._limiter)

    async def _run_step(self, batch: list[Work]) -> None:
        releases = self._take_releases()
        if releases:  # released while the batch formed: their KV goes now, so their items must not run
            batch = [w for w in batch if w.item.session not in self._released]
        if not batch:
            if releases:
                await trio.to_thread.run_sync(self._release_sync, releases, limiter=self._limiter)
            return
        items = [w.item for w in batch]
        hook = self._layer_hook(batch) if self._layer_hook is not None else None
        t0 = trio.current_time()
        outcomes = await trio.to_thread.run_sync(self._step_sync, releases, items, hook, limiter=self._limiter)
        self.steps += 1
        if self._pace is not None:
            # Device emulation: the step lasts as long as the emulated device's (dilated) step would.
            await trio.sleep_until(t0 + self._pace(items))
        tokens = sum(item.num_tokens for item in items)
        self.last_step_s = elapsed = trio.current_time() - t0
        self.rate.step(tokens, elapsed)
        if any(item.num_tokens > 1 for item in items):
            self.prefill_rate.step(tokens, elapsed)
        if self.on_step is not None:
            self.on_step(items, elapsed)
        done: list[tuple[Work, ItemResult]] = []
        for work, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, ItemResult):
                done.append((work, outcome))
            else:
                await self._fail(work, outcome, "lost")
        if done:
            await self._deliver(done)

    def _take_releases(self) -> list[SessionId]:
        """Sessions to free in the engine; the ledger forgets them at the same time, before the next step."""
        for session in self._releases:
            self.ledger.release(session)
        releases = self._engine_releases + self._releases
        self._releases, self._engine_releases = [], []
        self._grant()
        return releases

    def _receive(self, work: Work | None) -> None:
        if work is not None:
            self.queued_tokens -= work.item.num_tokens
            self._deferred.append(_Queued(work))

    async def _next_batch(self) -> list[Work]:
        if not self._deferred or self._stalled:
            self._receive(await self._recv.receive())
        # Everything already here, without waiting for more.
        while True:
            try:
                work = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            self._receive(work)
        # Released sessions leave the ledger now (and the engine before the step), so the step may use their KV;
        # hand-offs waiting for room get it first, as the simulator's hops grant them at a release.
        for session in self._releases:
            self.ledger.release(session)
        self._engine_releases += self._releases
        self._releases = []
        self._grant()
        queue = [q for q in self._deferred if q.session not in self._released]
        step = self.policy.form(queue)
        for q in step.refused:
            await self._fail(q.work, self.policy.refusal(q), "refused")
        for q in step.dropped:
            await self._fail(q.work, PREEMPTED, "preempted")
        self._engine_releases += [SessionId(str(s)) for s in step.preempted]
        batch = [q.work for q in step.batch]
        waiting = step.waiting
        if step.split is not None:
            k = step.split_tokens
            piece, rest = split_item(step.split.work.item, k)
            whole = step.split.work
            batch[step.batch.index(step.split)] = Work(piece, whole.ctx, whole.prefill_end)
            rest_work = Work(rest, whole.ctx, whole.prefill_end)
            waiting = [_Queued(rest_work) if q is step.split else q for q in waiting]
        self._deferred = waiting
        self._stalled = step.stalled
        return batch

    def _release_sync(self, sessions: list[SessionId]) -> None:
        for s in sessions:
            self.engine.release(s)
        self.kv = self.engine.kv_usage()

    def _step_sync(self, releases: list[SessionId], items: list[StepItem],
                   hook: LayerDone | None) -> list[ItemResult | str]:
        """In the worker thread: free released sessions, then one step; isolate bad items if it fails."""
        self._release_sync(releases)
        try:
            steps = self.engine.step(items) if hook is None else self.engine.step(items, hook)
            results: list[ItemResult | str] = list(steps)
        except EngineError as exc:
            # The engine changed nothing (it refuses before any layer, so the hook saw none); find the items at
            # fault by running each on its own, without the hook: what it would have sent goes after the step.
            results = [str(exc)] if len(items) == 1 else [self._step_one(item) for item in items]
        except KVCacheFull as exc:
            # The ledger reserved everything this step allocates, so this is a bookkeeping bug, not a full node.
            log.error("KV cache full inside the ledger's reservations: %s", exc)
            results = [f"KV accounting error on this node: {exc}"] * len(items)
        self.kv = self.engine.kv_usage()
        return results

    def _step_one(self, item: StepItem) -> ItemResult | str:
        try:
            return self.engine.step([item])[0]
        except EngineError as exc:
            return str(exc)

    def kv_usage(self) -> KVUsage:
        return self.kv
