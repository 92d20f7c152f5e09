"""The outbox: ordered delivery per peer, failures reported, and a clean refusal once it is shutting down."""

from __future__ import annotations

from typing import Any

import trio

from hetnode.ids import NodeId
from hetnode.protocol.mailbox import Mailbox
from hetnode.protocol.memory import MemoryNetwork
from hetnode.protocol.messages import INFER_PROTOCOL, Ready, infer_decoder
from hetnode.protocol.outbox import Outbox


async def test_messages_reach_the_peer_in_order_and_flush_waits_for_them() -> None:
    net = MemoryNetwork()
    got: list[str] = []
    all_in = trio.Event()
    async with net.transport("a") as a, net.transport("b") as b:
        async def on_message(peer: NodeId, msg: Any, payload: bytes | None) -> None:
            got.append(msg.session)
            if len(got) == 20:
                all_in.set()

        receiver = Mailbox(b, INFER_PROTOCOL, infer_decoder, on_message, lambda p: True)
        receiver.install()
        failed: list[NodeId] = []

        async def on_fail(peer: NodeId, msg: Any, reason: str) -> None:
            failed.append(peer)

        outbox = Outbox(Mailbox(a, INFER_PROTOCOL, infer_decoder, on_message, lambda p: True), on_fail)
        async with trio.open_nursery() as nursery:
            await nursery.start(outbox.run)
            for i in range(20):
                assert outbox.post(b.peer_id, Ready(session=f"s{i}"))
            assert outbox.post(NodeId("nobody"), Ready(session="lost"))
            assert await outbox.flush(10.0)
            with trio.fail_after(10):
                await all_in.wait()
            nursery.cancel_scope.cancel()
    assert got == [f"s{i}" for i in range(20)]
    assert failed == [NodeId("nobody")]


async def test_a_post_while_the_outbox_shuts_down_is_refused_not_raised() -> None:
    """A batch step that ends while the node is being cancelled still posts its results; the outbox's nursery
    no longer takes tasks then, and the post must say False (found by a CI run: 'Nursery is closed to new
    arrivals' escaped a node's batch loop and failed a re-route test)."""
    net = MemoryNetwork()
    async with net.transport("a") as a:
        in_on_fail = trio.Event()
        release = trio.Event()

        async def on_fail(peer: NodeId, msg: Any, reason: str) -> None:
            in_on_fail.set()
            with trio.CancelScope(shield=True):  # keeps a sender alive past the cancel, as a slow send would
                await release.wait()

        async def on_message(peer: NodeId, msg: Any, payload: bytes | None) -> None:
            pass

        outbox = Outbox(Mailbox(a, INFER_PROTOCOL, infer_decoder, on_message, lambda p: True), on_fail)
        scope = trio.CancelScope()

        async def run_outbox(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with scope:
                await outbox.run(task_status=task_status)

        async with trio.open_nursery() as nursery:
            await nursery.start(run_outbox)
            assert outbox.post(NodeId("nobody"), Ready(session="s"))
            await in_on_fail.wait()
            scope.cancel()
            await trio.sleep(0.05)  # the outbox's body has ended; its sender is still in on_fail
            refused = outbox.post(NodeId("other"), Ready(session="t"))
            release.set()
    assert refused is False
