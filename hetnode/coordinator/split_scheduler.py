"""Routing for a phase-split plan (Splitwise §IV-B, its cluster-level scheduler "CLS"): each request gets a
prefill replica and a decode replica at arrival.

Both picks are join-the-shortest-queue on pending tokens. A prefill replica's pending tokens are the prompts
routed to it and not yet prefilled; a decode replica's are the KV tokens its requests hold (prompt plus the
current average output), the same estimate as the Helix scheduler's mask. The decode replica is picked in the
prefill replica's region when one there has room (the KV then crosses no wide-area link), else anywhere.

Both are picked at arrival, so the decode side's KV is accounted for before the prefill starts (Splitwise
assigns both machines at once for this reason; the nodes reserve the blocks for real when the route is
installed). A replica is masked while adding the request would take one of its nodes over the high-water mark
of its KV: prefill nodes are charged the prompt until it is prefilled (`prefilled`), decode nodes the prompt
plus the average output until the request ends. A request that finds no pair waits in a bounded FIFO queue.

Where the decode side's KV is booked is a setting, `decode_booking`:

- "admission" (the default, Splitwise's rule, above): both replicas are charged when the request is admitted.
- "handoff" (ThunderServe's KV cache queues, its Appendix on the implementation: "KV cache queues are maintained
  on the prefill replicas, and upon completion of a decoding round, the decode replicas retrieve KV caches from
  these queues, utilizing the GPU memory of the prefill replicas as queuing buffers"): admission is limited by the
  prefill side only. The decode replica is still picked at admission, by the same rule (JSQ here, the
  orchestration's pairs in TSTP), among those whose KV could hold the request at all, so the route is one
  `Decision` as before; what moves is the booking. The prefill replica's nodes are charged the prompt until its
  KV has been handed over (`partial_done`), not just until it is prefilled: they are the queue's buffer. At
  `prefilled` the request joins its decode replica's FIFO; the head of each FIFO is charged on the decode nodes
  (prompt plus the average output, under the high-water mark, as at admission) as soon as they have room, and
  `take_handoffs` gives the executor the requests whose hand-off may start now, in that order.
  Why picked at admission and not at the hand-off (the true pull): the route's two phases are installed and
  routed as one today (both executors, the hops' Install), and the pick by X/Y is the plan's orchestration per
  request; re-picking at the hand-off would need a route in two parts. The decode side's queue is per replica and
  strictly FIFO, so a large request is not starved by small ones behind it.

The public API is `PipelineScheduler`'s (submit, prefilled, finish, cancel, node_down, set_capacity, largest_kv,
queue_len, running, down, kv_estimate, pipeline_of), so the coordinator and the simulator drive it unchanged;
with "handoff" the executor also calls `partial_done` and `take_handoffs`, after every call that can free KV (both
do: the runtime's `Deployment._wake`, the simulator's `SimCoordinator._admit_queued`).
Pure: no I/O, no clock (every call passes `now`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from hetnode.coordinator.scheduler import Decision, NodeDown, NodeKV, PipelineHop, QueuedScheduler
from hetnode.errors import ConfigError
from hetnode.planner.plan import PlacementPlan
from hetnode.policy.decode_booking import ADMISSION, DECODE_BOOKINGS, HANDOFF


@dataclass(slots=True)
class _Replica:
    role: str
    hops: tuple[PipelineHop, ...]
    nodes: tuple[int, ...]
    region: str
    pending: float = 0.0  # tokens (see the module docstring)
    down: bool = False


@dataclass(slots=True)
class _Running:
    prefill: int  # replica indices
    decode: int
    input_len: int
    prefilling: bool = True
    # The charges it holds: the prefill nodes' (until prefilled, or handed over with "handoff") and the decode
    # nodes' (from admission, or from its hand-off's start with "handoff").
    held: bool = True
    booked: bool = True


class SplitScheduler(QueuedScheduler):
    """Join-the-shortest-queue over a phase-split plan's replicas; see the module docstring.

    regions: each node's region (a node missing from it is in region ""). The other options are those of every
    `PipelineScheduler`: kv_capacity (tokens per node; missing: not limited), high_water, avg_output_len,
    queue_limit, seed (unused: the policy draws nothing at random). decode_booking: when the decode side's KV is
    charged, "admission" or "handoff" (module docstring).
    """

    name: ClassVar[str] = "cls"
    _unit = "replica pair"
    _full = "waiting: no prefill and decode replica pair has KV room under its high-water mark"

    def __init__(self, plan: PlacementPlan, *, kv_capacity: Mapping[str, int] | None = None,
                 high_water: float = 0.9, avg_output_len: float = 240.0, queue_limit: int = 1024, seed: int = 0,
                 regions: Mapping[str, str] | None = None, output_ratio: float = 1.0,
                 learn_output: bool = True, decode_booking: str = ADMISSION) -> None:
        if decode_booking not in DECODE_BOOKINGS:
            raise ConfigError(f"decode_booking must be one of {', '.join(DECODE_BOOKINGS)}, not {decode_booking!r}")
        super().__init__(high_water=high_water, avg_output_len=avg_output_len, queue_limit=queue_limit,
                         output_ratio=output_ratio, learn_output=learn_output)
        roles = {r.role for r in plan.replicas}
        if not {"prefill", "decode"} <= roles or not roles <= {"prefill", "decode"}:
            raise ConfigError(f"plan {plan.cluster}/{plan.model} is not a phase-split plan: its replicas' roles "
                              f"are {sorted(roles) or 'none'}, it needs prefill and decode ones")
        ranges = plan.ranges()
        self.plan = plan
        self._names = sorted(ranges)
        index = {n: i for i, n in enumerate(self._names)}
        self._index = index
        capacity = dict(kv_capacity or {})
        self._capacity: list[int | None] = [capacity.get(n) for n in self._names]
        self._load = [0.0] * len(self._names)  # charged tokens per node
        self._requests = [0] * len(self._names)  # decode requests per node (charged the average output)
        self._down: set[int] = set()
        self._replicas: list[_Replica] = []
        for r in plan.replicas:
            layer = 0
            hops = []
            for node in r.nodes:
                if node not in ranges or ranges[node][0] != layer:
                    raise ConfigError(f"plan {plan.cluster}/{plan.model}: {r.role} replica {' -> '.join(r.nodes)} "
                                      f"does not run every layer once, in order")
                hops.append(PipelineHop(node, *ranges[node]))
                layer = ranges[node][1]
            if layer != plan.num_layers:
                raise ConfigError(f"plan {plan.cluster}/{plan.model}: {r.role} replica {' -> '.join(r.nodes)} "
                                  f"ends at layer {layer} of {plan.num_layers}")
            self._replicas.append(_Replica(r.role, tuple(hops), tuple(index[n] for n in r.nodes),
                                           (regions or {}).get(r.nodes[0], "")))
        self._running: dict[str, _Running] = {}
        self.decode_booking = decode_booking
        self._pull = decode_booking == HANDOFF
        # "handoff": per decode replica, the prefilled requests waiting for its KV room (FIFO), and the requests
        # whose hand-off may start, not yet taken by the executor.
        self._waiting: dict[int, deque[tuple[str, _Running]]] = {}
        self._handoffs: list[str] = []

    # -- public API (PipelineScheduler's) -------------------------------------------------------------------------

    def prefilled(self, request_id: str, now: float) -> list[Decision]:
        """The request's prompt is prefilled (its first token is out): its prefill replica is free of it."""
        running = self._running.get(request_id)
        if running is None or not running.prefilling:
            return []
        self._now = max(self._now, now)
        self._release_prefill(running)
        if self._pull:  # its KV stays on the prefill nodes (charged) until it is handed over
            self._waiting.setdefault(running.decode, deque()).append((request_id, running))
        return self._drain(self._now)

    def partial_done(self, request_id: str, now: float) -> list[Decision]:
        """Every prefill hop has handed the request's KV over: with "handoff", the prefill nodes are free of it."""
        running = self._running.get(request_id)
        if running is None or not self._pull or running.prefilling or not running.held:
            return []
        self._now = max(self._now, now)
        self._release_held(running)
        return self._drain(self._now)

    def take_handoffs(self) -> list[str]:
        """With "handoff": the requests whose decode KV has been charged since the last call, whose hand-off may
        start now (in the order they were charged); always empty with "admission"."""
        out, self._handoffs = self._handoffs, []
        return out

    def waiting_handoffs(self) -> int:
        """Prefilled requests waiting for their decode replica's KV room ("handoff"; 0 with "admission")."""
        return sum(len(q) for q in self._waiting.values())

    def node_down(self, node: str, now: float | None = None) -> NodeDown:
        """Mask every replica the node is part of; requests whose remaining phases pass through it are affected."""
        if now is not None:
            self._now = max(self._now, now)
        v = self._index.get(node)
        if v is None or v in self._down:
            return NodeDown(node, (), ())
        self._down.add(v)
        for replica in self._replicas:
            if v in replica.nodes:
                replica.down = True
        affected = tuple(rid for rid, r in self._running.items()
                         if v in self._replicas[r.decode].nodes
                         or (r.prefilling and v in self._replicas[r.prefill].nodes))
        return NodeDown(node, affected, self._reject_unservable())

    def set_capacity(self, node: str, tokens: int, now: float | None = None) -> list[Decision]:
        v = self._index.get(node)
        if tokens < 0:
            raise ValueError(f"kv capacity of {node} must be >= 0, not {tokens}")
        if v is None or self._capacity[v] == tokens:
            return []
        self._now = self._now if now is None else max(self._now, now)
        self._capacity[v] = tokens
        return self._drain(self._now)

    @property
    def largest_kv(self) -> float:
        """The largest prompt (tokens) a pair of up replicas could ever take: inf when nothing is limited,
        -inf when a role has no replica left."""
        return min(self._largest("prefill"), self._largest("decode"))

    def kv_estimate(self) -> dict[str, NodeKV]:
        return {name: NodeKV(self._requests[i], self._load[i] + self._requests[i] * self._output.mean,
                             self._capacity[i], self.high_water) for i, name in enumerate(self._names)}

    def pipeline_of(self, request_id: str) -> tuple[PipelineHop, ...] | None:
        """The pipeline the request runs on now: its prefill replica's until prefilled, then its decode one's."""
        running = self._running.get(request_id)
        if running is None:
            return None
        return self._replicas[running.prefill if running.prefilling else running.decode].hops

    @property
    def down(self) -> frozenset[str]:
        return frozenset(self._names[v] for v in self._down)

    def pending(self) -> list[tuple[str, tuple[str, ...], float]]:
        """Each replica's role, nodes and pending tokens (for status pages and tests)."""
        return [(r.role, tuple(h.node for h in r.hops), r.pending + (self._output.mean * self._decoding(r)
                                                                     if r.role == "decode" else 0.0))
                for r in self._replicas]

    # -- the policy -------------------------------------------------------------------------------------------

    def _limit(self, v: int) -> float:
        cap = self._capacity[v]
        return math.inf if cap is None else self.high_water * cap

    def _fits(self, replica: _Replica, need: float, avg: float) -> bool:
        return all(self._load[v] + self._requests[v] * avg + need <= self._limit(v) for v in replica.nodes)

    def _decoding(self, replica: _Replica) -> int:
        return self._requests[replica.nodes[0]] if replica.nodes else 0

    def _assign(self, request_id: str, input_len: int, waited: float) -> Decision | None:
        avg = self._output.mean
        prefill = self._shortest("prefill", input_len, avg, "")
        if prefill is None:
            return None
        decode = self._shortest("decode", input_len + avg, avg, self._replicas[prefill].region)
        if decode is None:
            return None
        return self._book(request_id, prefill, decode, input_len, waited)

    def _open(self, replica: _Replica, need: float, avg: float) -> bool:
        """May the replica be picked now for `need` tokens: up, with room under its high-water mark; a decode
        replica with "handoff", room were it idle (its KV is charged later, when it has room)."""
        if replica.down:
            return False
        if self._pull and replica.role == "decode":
            return all(need <= self._limit(v) for v in replica.nodes)
        return self._fits(replica, need, avg)

    def _book(self, request_id: str, prefill: int, decode: int, input_len: int, waited: float) -> Decision:
        """Route a request through the pair (prefill, decode): its prompt's tokens count on both replicas."""
        p, d = self._replicas[prefill], self._replicas[decode]
        p.pending += input_len
        d.pending += input_len
        for v in p.nodes:
            self._load[v] += input_len
        if not self._pull:
            self._charge_decode(d, input_len)
        self._running[request_id] = _Running(prefill, decode, input_len, booked=not self._pull)
        return Decision(request_id, p.hops, decode=d.hops, waited_s=waited)

    def _charge_decode(self, d: _Replica, input_len: int) -> None:
        for v in d.nodes:
            self._load[v] += input_len
            self._requests[v] += 1

    def _start_handoffs(self) -> None:
        """Charge the head of each decode replica's FIFO while its nodes have room ("handoff")."""
        avg = self._output.mean
        for i, queue in self._waiting.items():
            d = self._replicas[i]
            while queue and not d.down:
                rid, running = queue[0]
                if not self._fits(d, running.input_len + avg, avg):
                    break
                self._charge_decode(d, running.input_len)
                running.booked = True
                self._handoffs.append(rid)
                queue.popleft()

    def _drain(self, now: float) -> list[Decision]:
        if self._pull:
            self._start_handoffs()  # before admissions: they never compete for decode KV, but keep one order
        return super()._drain(now)

    def _shortest(self, role: str, need: float, avg: float, region: str) -> int | None:
        """The replica of `role` with room for `need` tokens and the fewest pending tokens; one in `region`
        first when a region is given. Ties go to the first replica of the plan."""
        best: tuple[bool, float, int] | None = None
        for i, r in enumerate(self._replicas):
            if r.role != role or not self._open(r, need, avg):
                continue
            pending = r.pending + (avg * self._decoding(r) if role == "decode" else 0.0)
            key = (bool(region) and r.region != region, pending, i)
            if best is None or key < best:
                best = key
        return None if best is None else best[2]

    def _release_prefill(self, running: _Running) -> None:
        """The prompt is prefilled: off the replica's queue; with "admission", its KV charge there too."""
        running.prefilling = False
        self._replicas[running.prefill].pending -= running.input_len
        if not self._pull:
            self._release_held(running)

    def _release_held(self, running: _Running) -> None:
        running.held = False
        for v in self._replicas[running.prefill].nodes:
            self._load[v] -= running.input_len

    def _release(self, running: _Running) -> None:
        if running.prefilling:
            self._release_prefill(running)
        if self._pull and running.held:
            self._release_held(running)
        d = self._replicas[running.decode]
        d.pending -= running.input_len
        if running.booked:
            for v in d.nodes:
                self._load[v] -= running.input_len
                self._requests[v] -= 1
        elif self._pull and not running.prefilling:  # it waited for the decode replica's room: it leaves the FIFO
            queue = self._waiting.get(running.decode)
            if queue is not None:
                self._waiting[running.decode] = deque(x for x in queue if x[1] is not running)

    def _largest(self, role: str) -> float:
        """The most KV tokens one up replica of `role` holds (its smallest node's pool)."""
        best = -math.inf
        for r in self._replicas:
            if r.role == role and not r.down:
                best = max(best, min((self._limit(v) for v in r.nodes), default=math.inf))
        return best / self.high_water

    def _unservable(self, input_len: int) -> str:
        for role in ("prefill", "decode"):
            if self._largest(role) == -math.inf:
                return f"no {role} replica avoids the nodes that are down ({', '.join(sorted(self.down))})"
        need = input_len + self._output.mean
        if input_len > self.high_water * self._largest("prefill"):
            return (f"the prompt of {input_len} tokens does not fit any prefill replica's KV under the high-water "
                    f"mark ({self.high_water * self._largest('prefill'):.0f} tokens)")
        if need > self.high_water * self._largest("decode"):
            return (f"the request needs about {need:.0f} tokens of KV ({input_len} prompt + {self._output.mean:.0f} "
                    f"expected output) and no decode replica has room for more than "
                    f"{self.high_water * self._largest('decode'):.0f} under the high-water mark")
        return ""
