"""The batch loop's stop: what was running is delivered, what was waiting is failed, nothing is left hanging; and
its reservations that wait for KV room (ThunderServe's KV queues): first come first granted, given up only when
released or stopped."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import pytest
import trio
import trio.testing

from hetnode.ids import SessionId
from hetnode.kv import KVUsage
from hetnode.node.batcher import BatchLoop, Work
from hetnode.node.engine.base import EngineConfig, ItemResult, StepItem


class _GatedEngine:
    """Steps block (in the worker thread) until the test opens the gate."""

    engine_config = EngineConfig()

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.steps: list[list[SessionId]] = []

    def step(self, items: Sequence[StepItem]) -> list[ItemResult]:
        self.steps.append([it.session for it in items])
        self.entered.set()
        self.gate.wait(10)
        return [ItemResult(it.session, token=1) for it in items]

    def release(self, session: SessionId) -> int:
        return 0

    def kv_usage(self) -> KVUsage:
        return KVUsage(block_size=16, total_blocks=8, used_blocks=0, free_blocks=8, sessions=0, tokens=0)


def work(session: str) -> Work:
    return Work(StepItem(SessionId(session), 0, token_ids=[1, 2]))


async def test_stop_finishes_the_step_under_way_and_fails_what_waits() -> None:
    engine = _GatedEngine()
    delivered: list[SessionId] = []
    failed: list[tuple[SessionId, str]] = []

    async def deliver(done: list[tuple[Work, ItemResult]]) -> None:
        delivered.extend(w.item.session for w, _ in done)

    async def fail(w: Work, reason: str, cause: str) -> None:
        failed.append((w.item.session, reason))

    loop = BatchLoop(engine, deliver=deliver, fail=fail)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(loop.run)
        await loop.submit(work("running"))
        await trio.to_thread.run_sync(engine.entered.wait)
        await loop.submit(work("queued-1"))
        await loop.submit(work("queued-2"))
        loop.release(SessionId("queued-2"))  # released work is dropped, not failed
        await loop.submit(work("queued-3"))
        async with trio.open_nursery() as stopping:
            stopping.start_soon(loop.stop, "shard replaced")
            await trio.testing.wait_all_tasks_blocked()
            engine.gate.set()
        # The loop task ended by itself: the outer nursery exits without a cancel.
    assert engine.steps == [[SessionId("running")]]
    assert delivered == [SessionId("running")]
    assert failed == [(SessionId("queued-1"), "shard replaced"), (SessionId("queued-3"), "shard replaced")]
    with pytest.raises(trio.ClosedResourceError):
        await loop.submit(work("late"))
    assert loop.queued_tokens == 0
    await loop.wait_idle()


async def test_stop_of_an_idle_loop_returns_at_once() -> None:
    async def nothing(*_: object) -> None:
        raise AssertionError("nothing ran")

    loop = BatchLoop(_GatedEngine(), deliver=nothing, fail=nothing)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(loop.run)
        with trio.fail_after(5):
            await loop.stop("idle")
            await loop.stop("again")  # idempotent


async def test_submit_nowait_says_when_the_queue_is_full() -> None:
    async def nothing(*_: object) -> None:
        pass

    loop = BatchLoop(_GatedEngine(), deliver=nothing, fail=nothing, queue_size=2)  # type: ignore[arg-type]
    assert loop.submit_nowait(work("a")) and loop.submit_nowait(work("b"))
    assert not loop.submit_nowait(work("c"))  # never waits: a full queue is the caller's to handle
    assert loop.queued_tokens == 2 * work("a").item.num_tokens


async def test_a_message_of_items_lands_in_one_step() -> None:
    """submit_all puts every item of a message in the queue before the loop can wake: an idle loop's next step
    takes them all (submitted one by one, it woke on the first and ran it alone, a whole step ahead of the rest)."""
    engine = _GatedEngine()
    engine.gate.set()

    async def nothing(*_: object) -> None:
        pass

    loop = BatchLoop(engine, deliver=nothing, fail=nothing)  # type: ignore[arg-type]
    async with trio.open_nursery() as nursery:
        await nursery.start(loop.run)
        await loop.submit_all([work(f"s{i}") for i in range(6)])
        await loop.wait_idle()
        nursery.cancel_scope.cancel()
    assert [len(step) for step in engine.steps] == [6]


class _PoolEngine:
    """An engine that only holds reservations: 8 blocks of 16 tokens."""

    engine_config = EngineConfig()

    def __init__(self) -> None:
        self.held: dict[SessionId, int] = {}

    def reserve_kv(self, session: SessionId, tokens: int) -> None:
        self.held[session] = -(-tokens // 16)
        assert sum(self.held.values()) <= 8

    def release(self, session: SessionId) -> int:
        return self.held.pop(session, 0)

    def kv_usage(self) -> KVUsage:
        used = sum(self.held.values())
        return KVUsage(block_size=16, total_blocks=8, used_blocks=used, free_blocks=8 - used, sessions=len(self.held),
                       tokens=16 * used)


async def test_queued_reservations_wait_for_room_in_order_and_give_up_only_when_released_or_stopped() -> None:
    async def nothing(*_: object) -> None:
        return None

    engine = _PoolEngine()
    loop = BatchLoop(engine, deliver=nothing, fail=nothing)  # type: ignore[arg-type]
    got: dict[str, bool] = {}
    done: dict[str, trio.Event] = {}

    async def reserve(name: str, tokens: int) -> None:
        done.setdefault(name, trio.Event())
        got[name] = await loop.reserve_queued(SessionId(name), tokens)
        done[name].set()

    async def answered(*names: str) -> None:  # (the engine's part runs in the worker thread)
        for name in names:
            await done.setdefault(name, trio.Event()).wait()

    async with trio.open_nursery() as nursery:
        await nursery.start(loop.run)
        await reserve("a", 100)  # 7 of 8 blocks, at once
        assert not await loop.reserve_queued(SessionId("huge"), 200)  # more than the whole pool: never
        nursery.start_soon(reserve, "b", 32)  # 2 blocks: waits
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(reserve, "c", 16)  # 1 block, which is free: still waits behind b
        nursery.start_soon(reserve, "d", 16)
        await trio.testing.wait_all_tasks_blocked()
        assert got == {"a": True} and loop.waiting_reservations == 3
        loop.release(SessionId("c"))  # gone while it waited: it gives up, and holds nothing
        await answered("c")
        assert got == {"a": True, "c": False} and loop.waiting_reservations == 2
        loop.release(SessionId("a"))  # the room comes back: b, then d, in order
        await answered("b", "d")
        assert got == {"a": True, "c": False, "b": True, "d": True}
        assert engine.held == {"b": 2, "d": 1} and loop.ledger.used == 3
        nursery.start_soon(reserve, "e", 96)  # 6 blocks, 5 free: waits until the loop stops
        await trio.testing.wait_all_tasks_blocked()
        assert "e" not in got
        await loop.stop("shard replaced")
        await answered("e")
        assert got["e"] is False and "e" not in engine.held
    assert not await loop.reserve_queued(SessionId("late"), 16)
