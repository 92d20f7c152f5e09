"""The dynamic batch loop around one engine (Helix §5.1): each step takes all work that arrived meanwhile.

Work arrives on a bounded channel, so a full node pushes back on its senders instead of growing a queue. The
loop waits for the first item, then drains whatever else is already queued (never waiting for more), up to
the step's token budget, and runs one engine step in the device's worker thread (CapacityLimiter(1): the
engine is not thread-safe). Results go to `deliver`; items that cannot run go to `fail` with a reason.
`stop` ends the loop without stranding anyone: the step under way completes and delivers, and every item still
queued goes to `fail`, so its requester hears about it instead of waiting for an answer that never comes.

The node's network stage and the single-process `LocalGenerator` both drive an engine through this loop.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from hetnode.ids import SessionId
from hetnode.kv import KVUsage
from hetnode.kv.blocks import KVCacheFull
from hetnode.node.engine.base import Engine, EngineError, ItemResult, StepItem

log = logging.getLogger(__name__)

# Sessions released recently: work for them that is still in flight is dropped, not run.
_RELEASED_MEMORY = 65536


@dataclass(frozen=True, slots=True)
class Work:
    item: StepItem
    ctx: Any = None  # whatever the owner needs to route the result (reply address, next stage, ...)


Deliver = Callable[[list[tuple[Work, ItemResult]]], Awaitable[None]]
Fail = Callable[[Work, str], Awaitable[None]]
Pace = Callable[[Sequence[StepItem]], float]


class BatchLoop:
    def __init__(self, engine: Engine, *, deliver: Deliver, fail: Fail, pace: Pace | None = None,
                 queue_size: int = 4096) -> None:
        self.engine = engine
        self._deliver = deliver
        self._fail = fail
        self._pace = pace
        # None wakes an idle loop so that a release frees KV at once rather than at the next step.
        self._send, self._recv = trio.open_memory_channel[Work | None](queue_size)
        self._limiter = trio.CapacityLimiter(1)
        self._deferred: deque[Work] = deque()
        self._releases: list[SessionId] = []
        self._released: OrderedDict[SessionId, None] = OrderedDict()
        self.queued_tokens = 0
        self.steps = 0
        self.kv = engine.kv_usage()
        self._idle = trio.Event()
        self._busy = False
        self._stopping: str | None = None
        self._stopped = trio.Event()

    async def wait_idle(self) -> None:
        """Until nothing is queued, deferred or waiting to be released (tests and graceful shutdown)."""
        while not self._is_idle():
            idle = self._idle = trio.Event()
            await idle.wait()

    def _is_idle(self) -> bool:
        if self._stopped.is_set():
            return True
        return (not self._busy and not self._deferred and not self._releases
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

    def release(self, session: SessionId) -> None:
        """Free the session's KV before the next step, and drop its work still queued."""
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
            self._stopped.set()
            self._idle.set()

    async def _fail_pending(self, reason: str) -> None:
        pending, self._deferred = list(self._deferred), deque()
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
                await self._fail(work, reason)
        releases, self._releases = self._releases, []
        if releases:
            await trio.to_thread.run_sync(self._release_sync, releases, limiter=self._limiter)

    async def _run_step(self, batch: list[Work]) -> None:
        releases, self._releases = self._releases, []
        if not batch:
            if releases:
                await trio.to_thread.run_sync(self._release_sync, releases, limiter=self._limiter)
            return
        items = [w.item for w in batch]
        t0 = trio.current_time()
        outcomes = await trio.to_thread.run_sync(self._step_sync, releases, items, limiter=self._limiter)
        self.steps += 1
        if self._pace is not None:
            # Device emulation: the step lasts as long as the emulated device's (dilated) step would.
            await trio.sleep_until(t0 + self._pace(items))
        done: list[tuple[Work, ItemResult]] = []
        for work, outcome in zip(batch, outcomes, strict=True):
            if isinstance(outcome, ItemResult):
                done.append((work, outcome))
            else:
                await self._fail(work, outcome)
        if done:
            await self._deliver(done)

    async def _next_batch(self) -> list[Work]:
        if not self._deferred:
            first = await self._recv.receive()
            if first is not None:
                self.queued_tokens -= first.item.num_tokens
                self._deferred.append(first)
        # Everything already here, without waiting for more.
        while True:
            try:
                work = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if work is not None:
                self.queued_tokens -= work.item.num_tokens
                self._deferred.append(work)
        budget = self.engine.engine_config.max_batch_tokens
        batch: list[Work] = []
        sessions: set[SessionId] = set()
        later: deque[Work] = deque()
        tokens = 0
        while self._deferred:
            work = self._deferred.popleft()
            item = work.item
            if item.session in self._released:
                continue
            # One item per session per step (a later prefill chunk waits for the earlier one), in order.
            if item.session in sessions or (tokens + item.num_tokens > budget and batch):
                later.append(work)
                continue
            batch.append(work)
            sessions.add(item.session)
            tokens += item.num_tokens
        self._deferred = later
        return batch

    def _release_sync(self, sessions: list[SessionId]) -> None:
        for s in sessions:
            self.engine.release(s)
        self.kv = self.engine.kv_usage()

    def _step_sync(self, releases: list[SessionId], items: list[StepItem]) -> list[ItemResult | str]:
        """In the worker thread: free released sessions, then one step; isolate bad items if it fails."""
        self._release_sync(releases)
        try:
            results: list[ItemResult | str] = list(self.engine.step(items))
        except (EngineError, KVCacheFull) as exc:
            # The engine changed nothing; find the items at fault by running each on its own.
            results = [_reason(exc)] if len(items) == 1 else [self._step_one(item) for item in items]
        self.kv = self.engine.kv_usage()
        return results

    def _step_one(self, item: StepItem) -> ItemResult | str:
        try:
            return self.engine.step([item])[0]
        except (EngineError, KVCacheFull) as exc:
            return _reason(exc)

    def kv_usage(self) -> KVUsage:
        return self.kv


def _reason(exc: Exception) -> str:
    if isinstance(exc, KVCacheFull):
        return f"out of KV cache memory on this stage: {exc}"
    return str(exc)
