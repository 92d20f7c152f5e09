"""The simulation proper: compute nodes, links and the coordinator, wired together by the event loop.

Events are few and coarse, which is what makes a 42-node, 30-minute run take seconds rather than hours: one
event per node step (its end) and one per link message (its arrival), never one per token. When a step ends,
its items are grouped by their next hop and each group travels as one message; a last hop sends at most one
message per first hop (the decode loop) and one to the coordinator (the step's tokens). Per-item work stays
in plain loops over lists of `SimRequest`s (slots classes), with sums done by `map` and `attrgetter` in C.

The loop itself only dispatches: each event kind has a handler registered with `register` (the built-in ones
too), and every decision a handler needs is a policy object's (the nodes' `BatchPolicy`, the coordinator's
scheduler and `Lifecycle`), the same objects the runtime calls. A new kind of event is a handler and a kind
number, a new decision a policy object; neither means editing this loop.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any

from hetnode.planner.cluster import COORDINATOR, ClusterSpec
from hetnode.planner.model import TOKEN_BYTES, ModelSpec
from hetnode.planner.plan import SOURCE
from hetnode.testnet.sim.coordinator import SimCoordinator
from hetnode.testnet.sim.events import (
    ARRIVAL,
    COORD_MESSAGE,
    NODE_MESSAGE,
    RELEASE,
    STEP_DONE,
    EventQueue,
    grouped,
)
from hetnode.testnet.sim.handoff import SimHandoff
from hetnode.testnet.sim.links import SimLink
from hetnode.testnet.sim.node import SimNode

Handler = Callable[[float, Any, Any], None]  # (now, a, b) of an event
# SWARM's per-link delay estimate as Helix's simulator sets it up (`cluster_simulator.init_scheduler`:
# `SwarmParameters(initial_priority=0.05, smoothing_parameter=0.8)`): an unmeasured link counts as 50 ms, and each
# request moves the estimate 80% of the way to the time it took.
SWARM_INITIAL_S = 0.05
SWARM_SMOOTHING = 0.8
_NTOK = attrgetter("num_tokens")
_PF = attrgetter("pf")


class Network:
    """Nodes and the directed links between every two endpoints (the coordinator is index len(nodes))."""

    def __init__(self, cluster: ClusterSpec, model: ModelSpec, nodes: Sequence[SimNode],
                 window: tuple[float, float]) -> None:
        self.cluster = cluster
        self.nodes = list(nodes)
        self.coordinator = len(self.nodes)
        self.window = window
        self.names = [n.name for n in self.nodes] + [COORDINATOR]
        # Endpoint indices by name, the coordinator also as the plan's SOURCE (where a scheduler's walk starts).
        self.index = {name: i for i, name in enumerate(self.names)} | {SOURCE: self.coordinator}
        self._activation = model.activation_bytes
        size = len(self.names)
        self.table: list[list[SimLink | None]] = [[None] * size for _ in range(size)]

    def link(self, src: int, dst: int) -> SimLink:
        found = self.table[src][dst]
        if found is None:
            a, b = self.names[src], self.names[dst]
            spec = self.cluster.link(a, b)
            per_token = TOKEN_BYTES if COORDINATOR in (a, b) else self._activation
            found = self.table[src][dst] = SimLink(f"{a}->{b}", spec.bytes_per_s, spec.latency_s, per_token)
        return found

    def links(self) -> list[SimLink]:
        """Every link that carried a message, in a stable order."""
        return [link for row in self.table for link in row if link is not None and link.messages]


class Simulation:
    def __init__(self, network: Network, events: EventQueue | None = None, *, per_item: bool = False,
                 decode_loop: str = "hop") -> None:
        self.network = network
        # One link message per item rather than per step and next hop (SimOptions.link_messages "item").
        self.per_item = per_item
        # A sampled token that goes on to its first hop travels by way of the coordinator (SimOptions.decode_loop
        # "coordinator", Helix's simulator) rather than straight from the last hop (the runtime's).
        self.via_coordinator = decode_loop == "coordinator"
        # SWARM's per-link delays when a scheduler asks for them (SimOptions.swarm_wiring "link"; None: not kept):
        # (sender index, receiver index) -> a moving average of the seconds from the sender's send to the end of the
        # receiver's step that ran the item, as Helix's SwarmScheduler measures them (`update_weights`).
        self.hop_delays: dict[tuple[int, int], float] | None = None
        self.nodes = network.nodes
        self.events = events or EventQueue()
        self.coordinator: SimCoordinator | None = None
        self.handoff: SimHandoff | None = None  # KV hand-offs between phases (set by whoever runs such routes)
        self.on_arrival: Callable[[int, float], None] = _no_arrivals
        self.processed = 0
        self.handlers: list[Handler] = []
        for kind, handler in ((NODE_MESSAGE, self._node_message), (STEP_DONE, self._step_done),
                              (COORD_MESSAGE, self._coord_message), (ARRIVAL, self._arrival),
                              (RELEASE, self._release)):
            if self.register(handler) != kind:
                raise AssertionError("the built-in event kinds are registered in the order events.py numbers them")
        self._relay_kind = self.register(self._relayed)

    # -- the wiring the coordinator uses --------------------------------------------------------------

    def send(self, src: int, dst: int, items: list[Any], now: float) -> None:
        """One message of `items` from endpoint src to dst, over their link's FIFO queue."""
        net = self.network
        if self.per_item and len(items) > 1 and dst != net.coordinator:
            for item in items:  # each queued on the link behind the one before, arriving on its own
                self.send(src, dst, [item], now)
            return
        link = net.table[src][dst] or net.link(src, dst)
        n = len(items)
        if self.hop_delays is not None and dst != net.coordinator:
            for item in items:
                item.hop_from = src
                item.hop_sent = now
        if dst == net.coordinator:  # one sampled token (or a chunk's done) per item
            arrive = link.send(now, n, n, sum(map(_PF, items)), net.window)
            kind = COORD_MESSAGE
        else:  # token ids from the coordinator, hidden states between nodes: every token of every item
            arrive = link.send(now, sum(map(_NTOK, items)), n, sum(map(_PF, items)), net.window)
            kind = NODE_MESSAGE
        heapq.heappush(self.events.heap, (arrive, next(self.events.seq), kind, dst, items))

    def send_ids(self, src: int, dst: int, items: list[Any], now: float) -> None:
        """Token ids from a last hop back to its first hop (the decode loop): 4 bytes a token, not a hidden
        state, on a link between two nodes."""
        net = self.network
        if self.via_coordinator:
            self._relay(src, dst, items, now)
            return
        if src == dst:
            # A one-node pipeline feeds its own queue, as the runtime's hop submits the token to its batch loop
            # before that loop forms its next step: the tokens join the very next step (this runs inside the
            # node's STEP_DONE, before it forms one).
            self.nodes[dst].queue.extend(items)
            return
        if self.per_item and len(items) > 1:
            for item in items:
                self.send_ids(src, dst, [item], now)
            return
        link = net.table[src][dst] or net.link(src, dst)
        if self.hop_delays is not None:
            for item in items:
                item.hop_from = src
                item.hop_sent = now
        arrive = link.send(now, sum(map(_NTOK, items)), len(items), 0, net.window, TOKEN_BYTES)
        heapq.heappush(self.events.heap, (arrive, next(self.events.seq), NODE_MESSAGE, dst, items))

    def _relay(self, src: int, dst: int, items: list[Any], now: float) -> None:
        """The decode loop as Helix's simulator runs it: each token goes from the last hop to the coordinator (its
        sink), which issues the next iteration from its source to the first hop at once (`QueryManager.
        collect_finished_request`), so a token pays both coordinator links' latencies, not the last->first one; a
        one-node pipeline loops through the coordinator too. The token rides on the message that streams it to the
        coordinator (`at_last_hop` has just queued that on the same link, so it arrives with it, and nothing is sent
        twice); the second leg queues on the coordinator's link to the first hop like any message."""
        link = self.network.table[src][self.network.coordinator] or self.network.link(src, self.network.coordinator)
        arrive = max(now, link.free) + link.latency_s
        heapq.heappush(self.events.heap, (arrive, next(self.events.seq), self._relay_kind, dst, items))

    def _relayed(self, now: float, dst: int, items: list[Any]) -> None:
        """Tokens relayed by the coordinator reached it: on to their first hop (`dst`), as token ids."""
        if items:  # empty when every item of it moved meanwhile (`purge`)
            self.send(self.network.coordinator, dst, items, now)

    def release(self, node: SimNode, session: int, now: float) -> None:
        """The coordinator's Release for a session: `node` frees its KV one link latency later."""
        self.events.push(now + self.delay(self.network.coordinator, node.index), RELEASE, node.index, session)

    def delay(self, src: int, dst: int) -> float:
        """How long a control message (Release, Install, Ready: a few bytes) takes from endpoint src to dst: the
        link's latency, or nothing where the cluster has no such link (a pruned cluster: control messages still
        reach every node, and their latency matters little next to a session's life)."""
        net = self.network
        link = net.table[src][dst]  # once built, the link is cached: no rule lookup per message
        if link is None and net.cluster.has_link(net.names[src], net.names[dst]):
            link = net.link(src, dst)
        return link.latency_s if link is not None else 0.0

    def purge(self, requests: set[int]) -> None:
        """Drop every item of the requests whose ids are in `requests` (moved off their routes): from the nodes'
        queues, steps under way and items held for KV, and from the link messages still travelling, as the
        runtime's hops drop the work of a released session. Rare (a node lost, a re-plan), so it scans."""
        for node in self.nodes:
            if node.queue:
                node.queue = [x for x in node.queue if id(x.origin) not in requests]
            if node.batch:
                node.batch = [x for x in node.batch if id(x.origin) not in requests]
            for session, held in list(node.kv_held.items()):
                node.kv_held[session] = [x for x in held if id(x.origin) not in requests]
        for _, _, kind, _, items in self.events.heap:
            if kind == NODE_MESSAGE or kind == self._relay_kind:
                items[:] = [x for x in items if id(x.origin) not in requests]

    def arrive_at(self, time: float, workload_index: int) -> None:
        self.events.push(time, ARRIVAL, workload_index)

    # -- event kinds ------------------------------------------------------------------------------------

    def register(self, handler: Handler) -> int:
        """A new kind of event: `handler(now, a, b)` runs for each one; returns the kind to push them with.
        The simulator's own kinds are registered this way too: the loop only dispatches."""
        self.handlers.append(handler)
        return len(self.handlers) - 1

    def _node_message(self, now: float, index: int, items: list[Any]) -> None:
        """A link message reached a node: its items join the queue; an idle node starts a step at once."""
        node = self.nodes[index]
        assert self.coordinator is not None
        if node.down or not items:
            return  # lost on the way, or every item of it moved meanwhile (`purge`)
        if self.coordinator.stragglers:
            items = [r for r in items if not r.origin.rejected]
        if node.kv_coming:  # a hop of a decode phase: its sessions' items wait for their handed-over KV
            assert self.handoff is not None
            items = self.handoff.hold(node, items)
            if not items:
                return
        if node.queue:
            node.queue.extend(items)
        else:
            node.queue = items
        if node.batch is None:
            self._step(node, now)

    def _step_done(self, now: float, index: int, dur: float) -> None:
        """A node finished its step: its items go on, one message per next hop, and its next step starts."""
        node = self.nodes[index]
        batch = node.batch
        node.batch = None
        assert batch is not None
        if node.down or not batch:
            return  # the node went down during the step, or every item of it moved meanwhile (`purge`)
        if self.hop_delays is not None:
            self._observe_hops(index, batch, now)
        kv = None
        if node.kv_out:  # a prefill hop: the KV its step computed goes to the next phase
            assert self.handoff is not None
            kv = self.handoff.step_done(node, batch, dur, now)
        d = node.only_next
        if d >= 0 or len(batch) == 1:
            self._forward(index, batch[0].nxt[index], batch, now)
        else:
            dests = [r.nxt[index] for r in batch]
            d = dests[0]
            if dests.count(d) == len(dests):
                self._forward(index, d, batch, now)
            else:
                for d, g in grouped(dests, batch).items():
                    self._forward(index, d, g, now)
        if kv is not None:  # after the tokens and activations, as the runtime's hop sends them
            assert self.handoff is not None
            if self.handoff.send(node, kv, now):
                return  # the node packs: its next step starts when that is done
        if node.queue:
            self._step(node, now)

    def _observe_hops(self, index: int, batch: list[Any], now: float) -> None:
        """Node `index` ran `batch`: each item's time from its sender's send to now updates that link's estimate."""
        delays = self.hop_delays
        assert delays is not None
        for r in batch:
            src = r.hop_from
            if src < 0:
                continue  # not sent since its last step counted (a piece of a prompt split here)
            r.hop_from = -1
            key = (src, index)
            old = delays.get(key, SWARM_INITIAL_S)
            delays[key] = old + SWARM_SMOOTHING * (now - r.hop_sent - old)

    def hop_delay(self, a: str, b: str) -> float:
        """SWARM's delay estimate from endpoint `a` (a node's name, or SOURCE for the coordinator) to node `b`."""
        names = self.network.index
        delays = self.hop_delays
        assert delays is not None
        return delays.get((names[a], names[b]), SWARM_INITIAL_S)

    def _forward(self, src: int, dst: int, items: list[Any], now: float) -> None:
        # A last hop's results do not go to the coordinator: the hop samples, loops back, and streams.
        if dst == self.network.coordinator:
            assert self.coordinator is not None
            self.coordinator.at_last_hop(src, items, now)
        else:
            self.send(src, dst, items, now)

    def _release(self, now: float, index: int, session: int) -> None:
        node = self.nodes[index]
        node.release(session, now)
        if self.handoff is not None and self.handoff.waiting.get(index):
            self.handoff.freed(index, now)  # hand-offs booked at their start wait here for KV room
        if node.batch is None and node.queue:
            self._step(node, now)

    def _coord_message(self, now: float, _: None, tokens: list[Any]) -> None:
        assert self.coordinator is not None
        self.coordinator.on_message(tokens, now)

    def _arrival(self, now: float, workload_index: int, _: None) -> None:
        self.on_arrival(workload_index, now)

    def _step(self, node: SimNode, now: float) -> None:
        """The one place a node starts a step: what its batch policy picks, ending when the profile says."""
        dur = node.form_batch(now)
        if node.failed:
            # Requests the node's policy refused or preempted: the coordinator moves or ends them.
            failed, node.failed = node.failed, []
            assert self.coordinator is not None
            self.coordinator.on_failed(failed, now)
        if dur >= 0:
            if node.kv_first:  # a decode phase's first hop: some session's first decode step may start now
                assert self.handoff is not None and node.batch is not None
                self.handoff.started(node, node.batch, now)
            heapq.heappush(self.events.heap, (now + dur, next(self.events.seq), STEP_DONE, node.index, dur))

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self, until: float, progress: Callable[[float], None] | None = None) -> float:
        """Process events up to simulated time `until` (inclusive); returns the time of the last one."""
        if self.coordinator is None:
            raise RuntimeError("the simulation has no coordinator")
        events = self.events
        heap = events.heap
        pop = heapq.heappop
        handlers = self.handlers
        processed = 0
        now = events.now
        while heap and heap[0][0] <= until:
            now, _, kind, a, b = pop(heap)
            handlers[kind](now, a, b)
            processed += 1
            if progress is not None and not processed & 0x3FFF:
                progress(now)
        events.now = max(events.now, now)
        self.processed += processed
        return now


def _no_arrivals(index: int, now: float) -> None:
    raise RuntimeError("an arrival event without a workload")
