"""One session as a hop serves it: its place on the route, what it may be sent and by whom, and the state of
its KV hand-offs in and out."""

from __future__ import annotations

from dataclasses import dataclass, field

import trio

from hetnode.ids import NodeId, SessionId
from hetnode.node.batcher import BatchLoop, Work
from hetnode.node.engine import SamplingParams
from hetnode.node.hop_stats import HopStats
from hetnode.protocol.messages import Item, Phase, Route, Sampling
from hetnode.protocol.routes import KVPeer, Place


def sampling_params(s: Sampling) -> SamplingParams:
    return SamplingParams(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed,
                          stop_token_ids=tuple(s.stop_token_ids), logprobs=s.logprobs)


@dataclass(eq=False)
class HopSession:
    """One session as this hop serves it."""

    id: SessionId
    coordinator: NodeId
    route: Route
    place: Place  # this node's phase and hop in the route
    sampling: SamplingParams
    prefill_end: int
    max_tokens: int
    lease_s: float
    loop: BatchLoop
    deadline: float
    next_start: int = 0  # the next position this hop expects (items are submitted in order)
    generated: int = 0  # last hop: tokens sampled so far (on the route: a decode phase starts at the first)
    span_end: int | None = None  # positions past it belong to the next phase (None: this phase decodes)
    # Hand-off in: for each layer held here, the next position whose KV the previous phase sends (`kv_from`
    # names the hop that sends it; a frame claims its positions when it is accepted, before its import, which
    # `kv_importing` counts); items wait in `held` until every layer has [0, kv_end) written.
    kv_end: int = 0
    kv_next: dict[int, int] = field(default_factory=dict)
    kv_from: dict[int, NodeId] = field(default_factory=dict)
    kv_importing: int = 0
    held: list[tuple[NodeId, Work]] = field(default_factory=list)
    kv_done: trio.Event = field(default_factory=trio.Event)  # set once every layer has [0, kv_end)
    # Hand-off out: the hops of the next phase that hold this hop's layers, and the next position to send; the
    # layers of positions [kv_sent, kv_stream_end) already streamed from inside the step, per target peer.
    kv_to: list[KVPeer] = field(default_factory=list)
    kv_sent: int = 0
    # Moving elsewhere with its KV: nothing more of the session leaves this hop (Freeze), positions [0, computed)
    # are in its KV here.
    frozen: bool = False
    computed: int = 0
    kv_streamed: dict[str, int] = field(default_factory=dict)
    kv_stream_end: int = 0
    # ThunderServe's KV queues (Install.kv_queued): the hand-off waits for the coordinator. A prefill hop keeps
    # its KV until SendKV; a hop of the next phase reserves its KV only on Reserve (`kv_reserved` from then; at
    # the Install otherwise), and takes no KV frame before. `kv_booked`: that word came (once per session).
    kv_queued: bool = False
    kv_booked: bool = False
    kv_reserved: bool = False
    trace: str = ""  # the request's trace id (Install), for logs and the hop's report
    stats: HopStats = field(default_factory=lambda: HopStats(trio.current_time()))

    @property
    def phase(self) -> Phase:
        return self.route.phases[self.place.phase]

    @property
    def hop(self) -> int:
        return self.place.hop

    @property
    def kv_waiting(self) -> bool:
        """Items cannot run yet: some layer's handed-over KV has not all arrived."""
        return self.kv_importing > 0 or any(pos < self.kv_end for pos in self.kv_next.values())

    @property
    def is_first(self) -> bool:
        return self.hop == 0

    @property
    def is_last(self) -> bool:
        return self.hop == len(self.phase.hops) - 1

    def sender_problem(self, peer: NodeId, item: Item) -> str:
        """Why `peer` may not send `item` of this session here ('' when it may)."""
        hops = self.phase.hops
        if self.span_end is not None and item.start + item.count > self.span_end:
            return f"this phase runs positions up to {self.span_end}; the next phase runs the rest"
        if not self.is_first:
            prev = NodeId(hops[self.hop - 1].peer)
            return "" if peer == prev else f"only the previous hop {prev} sends this session's items here"
        if item.start < self.prefill_end:
            if peer != self.coordinator:
                return "only the installing coordinator sends a session's context"
            if item.start + item.count > self.prefill_end:
                return f"context items end at position {self.prefill_end}"
            return ""
        if item.count != 1:
            return "a decode item carries one token"
        if self.place.phase > 0 and item.start == self.kv_end == self.prefill_end:
            handing = NodeId(self.route.phases[self.place.phase - 1].hops[-1].peer)
            return "" if peer == handing else "only the previous phase's last hop hands over the first token"
        return "" if peer == NodeId(hops[-1].peer) else "only the phase's last hop feeds decode tokens back"
