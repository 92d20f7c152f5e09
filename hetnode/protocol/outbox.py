"""Per-peer queues in front of a Mailbox: whoever posts never waits on the network.

A node's batch loop hands its step's messages to `post` and goes on with the next step; one sender task per
destination drains that destination's queue in order over the mailbox's stream. A slow or dead peer therefore
delays only its own traffic. A queue is bounded: when one is full, `post` says so at once and the caller fails
what it carried rather than growing memory without limit. A message that cannot be sent goes to `on_fail`, so
the sessions it carried can be failed (their coordinators move them) instead of waiting out a timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import trio

from hetnode.errors import HetnodeError
from hetnode.ids import NodeId
from hetnode.protocol.mailbox import Mailbox

log = logging.getLogger(__name__)

OnFail = Callable[[NodeId, Any, str], Awaitable[None]]
_Entry = tuple[msgspec.Struct, bytes | memoryview | None]


class Outbox:
    def __init__(self, mailbox: Mailbox, on_fail: OnFail, *, capacity: int = 1024) -> None:
        self.mailbox = mailbox
        self.on_fail = on_fail
        self.capacity = capacity
        self._queues: dict[NodeId, trio.MemorySendChannel[_Entry]] = {}
        self._nursery: trio.Nursery | None = None
        self._closed = False
        self._pending = 0  # posted and not yet sent (or failed)
        self._flushed = trio.Event()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                # Closed as soon as the body ends, not when the senders have finished: from then on the nursery
                # refuses new tasks, and a batch step finishing during shutdown must get False, not an error.
                self._closed = True

    def post(self, peer: NodeId, msg: msgspec.Struct, payload: bytes | memoryview | None = None) -> bool:
        """Queue `msg` for `peer` behind everything posted to it before; False when its queue is full or the
        outbox has shut down."""
        if self._closed:
            return False
        queue = self._queues.get(peer)
        if queue is None:
            if self._nursery is None:
                raise RuntimeError("Outbox.run() first")
            queue, recv = trio.open_memory_channel[_Entry](self.capacity)
            self._queues[peer] = queue
            self._nursery.start_soon(self._drain, peer, recv)
        try:
            queue.send_nowait((msg, payload))
            self._pending += 1
        except trio.WouldBlock:
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The sender task is gone (the node is shutting down): nothing will go out.
            self._queues.pop(peer, None)
            return False
        return True

    async def _drain(self, peer: NodeId, recv: trio.MemoryReceiveChannel[_Entry]) -> None:
        async with recv:
            async for msg, payload in recv:
                try:
                    await self.mailbox.send(peer, msg, payload)
                except HetnodeError as exc:
                    log.info("sending %s to %s failed: %s", type(msg).__name__, peer, exc)
                    await self.on_fail(peer, msg, str(exc))
                finally:
                    self._sent(1)

    def _sent(self, count: int) -> None:
        self._pending -= count
        if self._pending <= 0:
            self._pending = 0
            self._flushed.set()
            self._flushed = trio.Event()

    async def flush(self, timeout_s: float) -> bool:
        """Until everything posted so far has been sent or failed, at most `timeout_s`; True if it all went."""
        with trio.move_on_after(timeout_s):
            while self._pending:
                await self._flushed.wait()
        return not self._pending

    def forget(self, peer: NodeId) -> None:
        """Stop the sender to a peer that left; what was queued for it is dropped."""
        queue = self._queues.pop(peer, None)
        if queue is not None:
            queue.close()
