"""Which directed links to measure, and when: the coordinator orders probes one node at a time.

Probes that run at once share the prober's uplink (and, on a testnet, the CPU), so concurrent probes measure
each other rather than the link. The scheduler therefore measures at most `concurrency` links at a time
across the whole cluster: new members' links first, then every link again each `interval`. A node measures
the targets of one ProbeOrder one after another and answers with a LinkReport; the coordinator measures its
own links to nodes itself. The cost is bounded: one bulk transfer (at most ProbeSettings.max_bytes) per link
per round.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from hetnode.coordinator.registry import Registry
from hetnode.errors import HetnodeError
from hetnode.ids import NodeId
from hetnode.protocol.messages import LinkReport, ProbeOrder
from hetnode.protocol.probe import ProbeSettings, probe_link
from hetnode.protocol.transport import Transport

log = logging.getLogger(__name__)

SendOrder = Callable[[NodeId, ProbeOrder], Awaitable[bool]]


@dataclass
class _Waiting:
    src: NodeId
    done: trio.Event = field(default_factory=trio.Event)
    report: LinkReport | None = None


class ProbeScheduler:
    def __init__(self, registry: Registry, transport: Transport, send_order: SendOrder, *,
                 interval_s: float, settings: ProbeSettings = ProbeSettings()) -> None:
        self.registry = registry
        self.transport = transport
        self.send_order = send_order
        self.interval_s = interval_s
        self.settings = settings
        # src -> targets still to measure, in the order sources were queued.
        self.pending: dict[NodeId, list[NodeId]] = {}
        self._wake = trio.Event()
        self._orders = 0
        self._waiting: dict[int, _Waiting] = {}
        self.rounds_completed = 0

    # -- what to measure ---------------------------------------------------------------------------------

    def _enqueue(self, src: NodeId, dst: NodeId) -> None:
        targets = self.pending.setdefault(src, [])
        if dst not in targets:
            targets.append(dst)

    def member_joined(self, peer: NodeId) -> None:
        """Measure every link into and out of a new (or returning) member."""
        me = self.transport.peer_id
        others = [r.peer_id for r in self.registry.up_members() if r.peer_id != peer]
        for other in others:
            self._enqueue(peer, other)
            self._enqueue(other, peer)
        self._enqueue(peer, me)
        self._enqueue(me, peer)
        self._wake.set()

    def member_gone(self, peer: NodeId) -> None:
        self.pending.pop(peer, None)
        for targets in self.pending.values():
            if peer in targets:
                targets.remove(peer)

    def enqueue_all(self) -> None:
        me = self.transport.peer_id
        up = [r.peer_id for r in self.registry.up_members()]
        for src in up:
            for dst in [*up, me]:
                if dst != src:
                    self._enqueue(src, dst)
            self._enqueue(me, src)
        self._wake.set()

    def on_report(self, src: NodeId, report: LinkReport) -> bool:
        """A LinkReport arrived; True if it answered one of our orders."""
        waiting = self._waiting.get(report.order)
        if waiting is None or waiting.src != src:
            return False
        waiting.report = report
        waiting.done.set()
        return True

    # -- the loop ----------------------------------------------------------------------------------------

    async def run(self) -> None:
        next_round = trio.current_time() + self.interval_s
        while True:
            while not self.pending:
                wake = self._wake = trio.Event()
                with trio.move_on_at(next_round):
                    await wake.wait()
                if trio.current_time() >= next_round:
                    self.rounds_completed += 1
                    next_round = trio.current_time() + self.interval_s
                    self.enqueue_all()
            src = next(iter(self.pending))
            targets = [t for t in self.pending.pop(src) if self._measurable(t)]
            if not targets or not self._measurable(src):
                continue
            if src == self.transport.peer_id:
                await self._probe_ourselves(targets)
            else:
                await self._order(src, targets)

    def _measurable(self, peer: NodeId) -> bool:
        return peer == self.transport.peer_id or self.registry.is_member(peer)

    async def _probe_ourselves(self, targets: list[NodeId]) -> None:
        for dst in targets:
            if not self.registry.is_member(dst):
                continue
            try:
                m = await probe_link(self.transport, dst, self.settings)
            except (HetnodeError, OSError, trio.TooSlowError) as exc:
                log.info("probe from the coordinator to %s failed: %s", dst, exc)
                continue
            self.registry.report_links(self.transport.peer_id, [m])

    async def _order(self, src: NodeId, targets: list[NodeId]) -> None:
        self._orders += 1
        order = ProbeOrder(order=self._orders, targets=list(targets))
        waiting = self._waiting[order.order] = _Waiting(src)
        try:
            if not await self.send_order(src, order):
                return
            # Each target's probe is bounded by its own timeout on the node; allow for all of them.
            with trio.move_on_after(self.settings.timeout_s * len(targets) + 5):
                await waiting.done.wait()
            if waiting.report is None:
                log.info("node %s did not answer probe order %d in time", src, order.order)
        finally:
            del self._waiting[order.order]
