"""Per-request pipelines (Helix §5): which nodes run which layers of one request, and when it has to wait.

A plan's edges form the *topology graph* (Helix Fig. 4): SOURCE -> nodes holding layer 0, node a -> node b
when b holds the layers right after a's last one (s_b <= e_a < e_b; with partial inference b runs only
[e_a, e_b)), and nodes holding the last layer -> SINK. The last layer a node holds only grows along an edge,
so the graph is a DAG, and the layers a node runs depend only on the node before it. A pipeline is a path
from SOURCE to SINK; it covers every layer exactly once, in order.

`PipelineScheduler` holds what every routing policy shares: the graph (per-vertex candidate lists built once,
so a decision costs O(pipeline length x degree)), the KV-cache estimate with its high-water mask (Helix
§5.2), the walk that finds a pipeline around masked nodes whenever one exists (at worst O(vertices + edges)),
and the bounded FIFO queue. A policy only says which of the unmasked candidates of one vertex to take
(`_pick`) and what to remember once the whole pipeline is fixed (`_commit`). `IwrrScheduler` is Helix's
policy; the baselines of Helix §6.7 are in `routing.py`.

Policies are pure objects: no I/O, no clock (every call passes `now`), randomness from a seeded generator,
so the coordinator and the simulator run the same code.

KV estimate. A running request is charged, on every node of its pipeline, its prompt length plus the
current average output length (in tokens: a node's paged KV pool keeps one slot per token for all the
layers it loaded, so a request that runs only part of a node's range still takes a whole slot). A candidate
is masked when adding the new request would take the estimate over `high_water x capacity`. The default
mark 0.9 is the one Helix's artifact uses for online serving; the rest of the pool absorbs the requests
that run longer than average, since the estimate charges each request its expected (not its worst) length.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypedDict

from hetnode.errors import ConfigError
from hetnode.planner.plan import SINK, SOURCE, PlacementPlan
from hetnode.protocol.messages import Hop, Phase, Route
from hetnode.protocol.routes import pipeline_route

EdgeSet = Literal["flows", "topology"]


@dataclass(frozen=True, slots=True)
class PipelineHop:
    """One node of a request's pipeline and the layers it RUNS for that request: [first_layer, last_layer)."""

    node: str
    first_layer: int
    last_layer: int  # exclusive

    @property
    def layers(self) -> int:
        return self.last_layer - self.first_layer


@dataclass(frozen=True, slots=True)
class Decision:
    """What became of one request: a pipeline (assigned), a place in the queue (queued), or a refusal.

    `reason` says why a request waits or was refused ("queue full (N waiting)" and the like); `waited_s`
    is how long it spent in the queue before this decision (0 for one decided on arrival).
    """

    request_id: str
    pipeline: tuple[PipelineHop, ...] | None = None
    queued: bool = False
    reason: str = ""
    waited_s: float = 0.0
    too_large: bool = False  # refused because no pipeline's KV could ever hold its prompt: the request's fault
    # Phase-split: the decode phase's pipeline; `pipeline` then only prefills and hands its KV over.
    decode: tuple[PipelineHop, ...] | None = None
    # Cronus's partial prefill: `pipeline` prefills tokens [0, split) and hands their KV to `decode`, which
    # prefills the rest and decodes (a mixed phase from `split`). None: `pipeline` prefills the whole context.
    split: int | None = None

    def __post_init__(self) -> None:
        if self.queued and self.pipeline is not None:
            raise ValueError("a decision is either a pipeline or a place in the queue, not both")
        if self.decode is not None and self.pipeline is None:
            raise ValueError("a decode pipeline needs a prefill pipeline before it")
        if self.split is not None and (self.decode is None or self.split < 1):
            raise ValueError(f"a partial prefill of {self.split} tokens needs a pipeline that finishes the prompt "
                             "and at least one token")

    @property
    def assigned(self) -> bool:
        return self.pipeline is not None

    @property
    def route(self) -> Route | None:
        """The request's route: one mixed phase over the pipeline (Helix's shape), prefill on `pipeline` then
        decode on `decode` (phase-split), or a partial prefill of [0, split) on `pipeline` then the rest and the
        decode on `decode` (Cronus); None when not assigned."""
        if self.pipeline is None:
            return None
        hops = _hops(self.pipeline)
        if self.decode is None:
            return pipeline_route(hops)
        if self.split is not None:
            return Route(phases=[Phase(kind="prefill", hops=hops, last_token=self.split),
                                 Phase(kind="mixed", hops=_hops(self.decode), first_token=self.split)])
        return Route(phases=[Phase(kind="prefill", hops=hops), Phase(kind="decode", hops=_hops(self.decode))])

    @property
    def rejected(self) -> bool:
        return self.pipeline is None and not self.queued


def _hops(pipeline: tuple[PipelineHop, ...]) -> list[Hop]:
    return [Hop(peer=h.node, first_layer=h.first_layer, last_layer=h.last_layer) for h in pipeline]


@dataclass(frozen=True, slots=True)
class NodeKV:
    """The scheduler's KV estimate for one node (tokens), for metrics."""

    requests: int
    tokens: float  # prompt tokens of its running requests + requests x the average output length
    capacity: int | None  # None: not limited
    high_water: float

    @property
    def usage(self) -> float:
        """Estimated share of the capacity in use (0 for an unlimited node)."""
        return self.tokens / self.capacity if self.capacity else 0.0


@dataclass(frozen=True, slots=True)
class NodeDown:
    """What `node_down` changed: running requests to re-route, and queued ones that nothing can serve now."""

    node: str
    affected: tuple[str, ...]  # running requests whose pipeline passes through the node (still charged)
    rejected: tuple[Decision, ...]  # queued requests that no pipeline can serve any more (out of the queue)


class SchedulerOptions(TypedDict, total=False):
    """The keyword options every policy takes (see `PipelineScheduler`)."""

    kv_capacity: Mapping[str, int]
    high_water: float
    avg_output_len: float
    output_ratio: float
    learn_output: bool
    queue_limit: int
    seed: int


@dataclass(slots=True)
class _Running:
    vertices: tuple[int, ...]  # node indices of the pipeline, in order
    input_len: int
    pipeline: tuple[PipelineHop, ...]


@dataclass(slots=True)
class _Waiting:
    input_len: int
    since: float


# One step of a walk: (vertex, positions of its eligible candidates, position taken).
Step = tuple[int, list[int], int]


class OutputLength:
    """Mean of the last `window` reported output lengths; the initial estimate counts as `prior` of them.

    A window follows a workload that drifts; the prior keeps the first few (possibly very short) outputs
    from swinging the estimate, and the KV mask with it, before there is data.
    """

    def __init__(self, initial: float, prior: int = 8, window: int = 1024, ratio: float = 1.0,
                 learn: bool = True) -> None:
        if not 0 < ratio < math.inf:
            raise ValueError(f"the output-length ratio must be finite and > 0, not {ratio}")
        self._samples: deque[float] = deque([float(initial)] * prior, maxlen=window)
        self._sum = float(initial) * prior
        self._adds = 0
        # The estimate is `ratio` x the mean: Helix's scheduler charged 1.0 x the expected output offline and
        # 0.6 x online (its requests mostly end before the pool fills); 1.0 charges the mean itself.
        self.ratio = ratio
        # Off: the initial estimate stays (Helix's scheduler charged a fixed expected output). A learned mean
        # follows the outputs that have ended, which early in a run are the short ones.
        self.learn = learn
        self.mean = float(initial) * ratio

    def add(self, length: float) -> None:
        if not self.learn:
            return
        if len(self._samples) == self._samples.maxlen:
            self._sum -= self._samples[0]
        self._samples.append(float(length))
        self._sum += length
        self._adds += 1
        if self._adds % 4096 == 0:  # a running sum drifts; resum exactly now and then
            self._sum = math.fsum(self._samples)
        self.mean = self.ratio * self._sum / len(self._samples)


def _edge_valid(plan: PlacementPlan, ranges: Mapping[str, tuple[int, int]], a: str, b: str) -> bool:
    if a == SOURCE:
        return b in ranges and ranges[b][0] == 0
    if b == SINK:
        return a in ranges and ranges[a][1] == plan.num_layers
    if a not in ranges or b not in ranges:
        return False
    (_, end_a), (start_b, end_b) = ranges[a], ranges[b]
    if plan.partial_inference:
        return start_b <= end_a < end_b
    return start_b == end_a


def plan_edges(plan: PlacementPlan, edges: EdgeSet = "flows") -> dict[tuple[str, str], float]:
    """The weighted edges a policy walks: the plan's positive flows, or every valid connection (weight 1) of the
    plan's connections when it names them.

    "flows" with a plan that has no positive flow at all (a hand-given placement) falls back to "topology".
    Raises ConfigError for a flow on an edge that the placement does not allow.
    """
    ranges = plan.ranges()
    if len(ranges) != len(plan.placements):
        raise ConfigError(f"plan {plan.cluster}/{plan.model}: a node appears twice in placements")
    for p in plan.placements:
        if not 0 <= p.first_layer < p.last_layer <= plan.num_layers:
            raise ConfigError(f"plan {plan.cluster}/{plan.model}: node {p.node} holds [{p.first_layer}, "
                              f"{p.last_layer}), not a non-empty range of the model's {plan.num_layers} layers")
    if edges == "flows":
        flows = {edge: float(f) for edge, f in plan.flows.items() if f > 0}
        for a, b in flows:
            if not _edge_valid(plan, ranges, a, b):
                raise ConfigError(f"plan {plan.cluster}/{plan.model}: flow on ({a}, {b}), which is not a valid "
                                  f"connection of the placement ({a}: {ranges.get(a)}, {b}: {ranges.get(b)})")
        if flows:
            return flows
    elif edges != "topology":
        raise ValueError(f"edges must be 'flows' or 'topology', not {edges!r}")
    names = [SOURCE, *sorted(ranges), SINK]
    # A plan that names its node-to-node connections (separate pipelines) keeps every policy on them.
    named = None if plan.connections is None else set(plan.connections)
    return {(a, b): 1.0 for a in names for b in names if a != b and _edge_valid(plan, ranges, a, b)
            and (named is None or a == SOURCE or b == SINK or (a, b) in named)}


class QueuedScheduler(ABC):
    """What every routing policy shares, whatever a route is: the requests running and their release, a bounded
    strict-FIFO queue of requests waiting for KV room, and the running mean output length.

    While anyone waits, new requests queue behind them, and `finish`/`cancel` start waiting requests from the
    head until one does not fit (so a long prompt is not starved by a stream of short ones). A request that could
    not fit even on an idle cluster is rejected, not queued. Subclasses say how a request is placed (`_assign`),
    freed (`_release`), and why it could never be (`_unservable`, `largest_kv`).
    """

    # What a subclass routes over, for reasons: "route" (a pipeline), "replica pair".
    _unit: ClassVar[str] = "route"
    _full: ClassVar[str] = "waiting: no route has KV room under its high-water mark"

    def __init__(self, *, high_water: float, avg_output_len: float, queue_limit: int,
                 output_ratio: float = 1.0, learn_output: bool = True) -> None:
        if not 0 < high_water <= 1:
            raise ValueError(f"high_water must be in (0, 1], not {high_water}")
        if not 0 <= avg_output_len < math.inf:
            raise ValueError(f"avg_output_len must be finite and >= 0, not {avg_output_len}")
        if queue_limit < 0:
            raise ValueError(f"queue_limit must be >= 0, not {queue_limit}")
        self.high_water = high_water
        self.queue_limit = queue_limit
        self._now = 0.0
        self._running: dict[str, Any] = {}
        self._queue: dict[str, _Waiting] = {}  # insertion order is FIFO order
        self._output = OutputLength(avg_output_len, ratio=output_ratio, learn=learn_output)

    def submit(self, request_id: str, input_len: int, now: float) -> Decision:
        """Route a new request: a route, a place in the queue, or a rejection with its reason."""
        if request_id in self._running or request_id in self._queue:
            state = "running" if request_id in self._running else "queued"
            raise ValueError(f"request {request_id!r} is already {state}")
        if input_len < 0:
            raise ValueError(f"input_len must be >= 0, not {input_len}")
        self._now = max(self._now, now)
        largest = self.largest_kv
        if largest > -math.inf and input_len > largest:
            return Decision(request_id, too_large=True, reason=f"prompt of {input_len} tokens needs more KV than "
                            f"any {self._unit} holds (largest: {largest:.0f} tokens)")
        unservable = self._unservable(input_len)
        if unservable:
            return Decision(request_id, reason=unservable)
        if not self._queue:
            decision = self._assign(request_id, input_len, 0.0)
            if decision is not None:
                return decision
        if len(self._queue) >= self.queue_limit:
            return Decision(request_id, reason=f"queue full ({len(self._queue)} waiting)")
        ahead = len(self._queue)
        self._queue[request_id] = _Waiting(input_len, now)
        why = f"waiting behind {ahead} queued request{'s' if ahead != 1 else ''}" if ahead else self._full
        return Decision(request_id, queued=True, reason=why)

    def prefilled(self, request_id: str, now: float) -> list[Decision]:
        """The request's prompt is prefilled; both executors call it at every first token. Nothing changes here
        unless the policy charges a prefill apart (the phase-split scheduler frees the prefill replica)."""
        return []

    def partial_done(self, request_id: str, now: float) -> list[Decision]:
        """The request's earlier phases are done with it (their hops handed the KV on). Nothing changes here
        unless the policy holds a place in such a phase until then (Cronus's PPI)."""
        return []

    def progress(self, request_id: str, output_len: int, now: float) -> None:
        """The request has generated `output_len` tokens; both executors may call it at every token. Only a policy
        that reads decodes' progress (EcoServe's saved TPOT) keeps it."""
        return None

    def finish(self, request_id: str, output_len: int, now: float) -> list[Decision]:
        """A running request ended after `output_len` generated tokens: free its KV estimate, learn from its
        length, and return what became of the queued requests that could now move (FIFO order)."""
        running = self._running.pop(request_id, None)
        if running is None:
            raise KeyError(f"request {request_id!r} is not running"
                           + (" (it is queued: cancel it instead)" if request_id in self._queue else ""))
        self._now = max(self._now, now)
        self._release(running)
        self._output.add(max(0, output_len))
        return self._drain(now)

    def cancel(self, request_id: str, now: float | None = None) -> list[Decision]:
        """Drop a queued or running request (client gone, node lost). Idempotent: an unknown id is a no-op.

        Returns the queued requests that the freed room let start (or that were rejected), as `finish` does.
        """
        now = self._now if now is None else max(self._now, now)
        self._now = now
        if self._queue.pop(request_id, None) is not None:
            return self._drain(now)  # it may have been the head that blocked the others
        running = self._running.pop(request_id, None)
        if running is None:
            return []
        self._release(running)
        return self._drain(now)

    def _reject_unservable(self) -> tuple[Decision, ...]:
        """Queued requests that nothing can serve any more (after a node went down) leave the queue, rejected."""
        rejected = []
        for rid, waiting in list(self._queue.items()):
            reason = self._unservable(waiting.input_len)
            if reason:
                del self._queue[rid]
                rejected.append(Decision(rid, reason=reason, waited_s=max(0.0, self._now - waiting.since)))
        return tuple(rejected)

    @property
    def queue_len(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def avg_output_len(self) -> float:
        return self._output.mean

    @property
    @abstractmethod
    def largest_kv(self) -> float:
        """The largest prompt (tokens) that could ever run: inf when nothing is limited, -inf when nothing is up."""

    @abstractmethod
    def _assign(self, request_id: str, input_len: int, waited: float) -> Decision | None:
        """Place the request now and charge it, or None when nothing has room."""

    @abstractmethod
    def _release(self, running: Any) -> None:
        """Take a running request's charges off."""

    @abstractmethod
    def _unservable(self, input_len: int) -> str:
        """Why nothing could ever take this request, even with nothing else running ('' if something could)."""

    def _drain(self, now: float) -> list[Decision]:
        out: list[Decision] = []
        while self._queue:
            rid, waiting = next(iter(self._queue.items()))
            waited = max(0.0, now - waiting.since)
            decision = self._assign(rid, waiting.input_len, waited)
            if decision is None:
                # The average output may have grown since it queued: if it cannot fit even on an idle
                # cluster it would wait forever (and block everyone behind it).
                reason = self._unservable(waiting.input_len)
                if not reason:
                    break
                decision = Decision(rid, reason=reason, waited_s=waited)
            del self._queue[rid]
            out.append(decision)
        return out


class NamedCapacityScheduler(QueuedScheduler):
    """A policy that keeps each node's KV capacity by node name (Cronus's and EcoServe's: whole-model nodes, no
    graph of vertices), replaced by what the node's heartbeats report."""

    _capacity: dict[str, int]

    def set_capacity(self, node: str, tokens: int, now: float | None = None) -> list[Decision]:
        """The node's KV pool holds `tokens`; returns the queued requests that the change let start, or left
        unservable, as `finish` does."""
        if tokens < 0:
            raise ValueError(f"kv capacity of {node} must be >= 0, not {tokens}")
        if self._capacity.get(node) == tokens:
            return []
        self._now = self._now if now is None else max(self._now, now)
        self._capacity[node] = tokens
        return self._drain(self._now)


class PipelineScheduler(QueuedScheduler):
    """Shared machinery of the routing policies; see the module docstring.

    kv_capacity: tokens of KV each node holds for its layers; a node missing from it is not limited.
    high_water: share of a node's capacity the estimate may reach before the node is masked, in (0, 1].
    avg_output_len: the output length assumed before any request finished (then a running mean).
    output_ratio: the KV estimate charges each request this share of that length (Helix: 1.0 offline, 0.6 online).
    learn_output: follow the outputs that ended (the running mean); off: keep avg_output_len (Helix's).
    queue_limit: the most requests that wait for KV room; one more is rejected ("queue full (N waiting)").
    seed: for the policies that draw at random.
    edges: "flows" walks only edges with flow in the plan; "topology" every valid connection.

    The queue is strict FIFO: while anyone waits, new requests queue behind them, and `finish`/`cancel`
    start waiting requests from the head until one does not fit (so a long prompt is not starved by a
    stream of short ones). A request that could not fit even on an idle cluster is rejected, not queued.
    """

    name: ClassVar[str] = ""
    _full = "waiting: every pipeline has a node whose KV estimate would pass its high-water mark"

    def __init__(self, plan: PlacementPlan, *, kv_capacity: Mapping[str, int] | None = None,
                 high_water: float = 0.9, avg_output_len: float = 240.0, queue_limit: int = 1024, seed: int = 0,
                 edges: EdgeSet = "flows", output_ratio: float = 1.0, learn_output: bool = True) -> None:
        super().__init__(high_water=high_water, avg_output_len=avg_output_len, queue_limit=queue_limit,
                         output_ratio=output_ratio, learn_output=learn_output)
        capacity = dict(kv_capacity or {})
        for node, cap in capacity.items():
            if cap < 0:
                raise ValueError(f"kv_capacity of {node} must be >= 0, not {cap}")
        self.plan = plan
        self.edges = edges
        self._rng = random.Random(seed)

        weighted = plan_edges(plan, edges)
        ranges = plan.ranges()
        self._names: list[str] = sorted(ranges)
        n = len(self._names)
        self._sink, self._source = n, n + 1
        index = {name: i for i, name in enumerate(self._names)} | {SINK: self._sink, SOURCE: self._source}
        self._index = index
        self._end = [ranges[name][1] for name in self._names] + [plan.num_layers, 0]
        # Per vertex, aligned lists: candidate vertices, their weights (edge flows), and the stage each one
        # runs when reached from this vertex (an empty one for SINK). Sorted by name: ties always break alike.
        self._cands: list[list[int]] = [[] for _ in range(n + 2)]
        self._weights: list[list[float]] = [[] for _ in range(n + 2)]
        self._stages: list[list[PipelineHop]] = [[] for _ in range(n + 2)]
        for (a, b), w in sorted(weighted.items(), key=lambda e: (index[e[0][0]], index[e[0][1]])):
            u, v = index[a], index[b]
            self._cands[u].append(v)
            self._weights[u].append(w)
            self._stages[u].append(PipelineHop(b, self._end[u], self._end[v] if v != self._sink else self._end[u]))

        self._order = sorted(range(n), key=lambda u: -self._end[u])  # an edge always leads to an earlier one here
        self._capacity: list[int | None] = [capacity.get(name) for name in self._names] + [None, None]
        self._cap_limit = [math.inf if c is None else high_water * c for c in self._capacity]
        self._limit = list(self._cap_limit)  # -inf once a node is down: masked for good
        self._down: set[int] = set()
        self._kv_prompt = [0] * (n + 2)  # prompt tokens of the running requests through each vertex
        self._kv_requests = [0] * (n + 2)  # running requests through each vertex
        self._running: dict[str, _Running] = {}
        self._has_path = self._bottleneck(capacity_limits=False, down=False) > -math.inf
        self._refresh_bottlenecks()

    # -- public API ---------------------------------------------------------------------------------------------

    def node_down(self, node: str, now: float | None = None) -> NodeDown:
        """Mask a node for good: no new pipeline goes through it.

        Its running requests stay charged until the caller finishes or cancels them (their KV on the other
        nodes is real until released); they are listed in `affected`. Queued requests that no pipeline can
        serve any more leave the queue as rejections.
        """
        if now is not None:
            self._now = max(self._now, now)
        v = self._index.get(node)
        if v is None or v >= self._sink or v in self._down:
            return NodeDown(node, (), ())
        self._down.add(v)
        self._limit[v] = -math.inf
        self._refresh_bottlenecks()
        affected = tuple(rid for rid, r in self._running.items() if v in r.vertices)
        return NodeDown(node, affected, self._reject_unservable())

    def set_capacity(self, node: str, tokens: int, now: float | None = None) -> list[Decision]:
        """The node's KV pool holds `tokens` (as it reports it), replacing the capacity given at construction.

        Returns the queued requests that the change let start, or left unservable, as `finish` does.
        """
        v = self._index.get(node)
        if tokens < 0:
            raise ValueError(f"kv capacity of {node} must be >= 0, not {tokens}")
        if v is None or v >= self._sink or self._capacity[v] == tokens:
            return []
        now = self._now if now is None else max(self._now, now)
        self._now = now
        self._capacity[v] = tokens
        self._cap_limit[v] = self.high_water * tokens
        if v not in self._down:
            self._limit[v] = self._cap_limit[v]
        self._refresh_bottlenecks()
        return self._drain(now)

    @property
    def largest_kv(self) -> float:
        """The most KV (tokens) one pipeline of up nodes holds: the largest prompt that could ever run (inf when
        no node is limited, -inf when no pipeline avoids the nodes that are down)."""
        # The high-water mark scales every node's limit alike, so it scales the best pipeline's bottleneck too.
        return self._largest / self.high_water

    def kv_estimate(self) -> dict[str, NodeKV]:
        """A snapshot of the KV estimate of every node in the plan."""
        avg = self._output.mean
        return {name: NodeKV(self._kv_requests[i], self._kv_prompt[i] + self._kv_requests[i] * avg,
                             self._capacity[i], self.high_water) for i, name in enumerate(self._names)}

    def pipeline_of(self, request_id: str) -> tuple[PipelineHop, ...] | None:
        running = self._running.get(request_id)
        return None if running is None else running.pipeline

    @property
    def down(self) -> frozenset[str]:
        return frozenset(self._names[v] for v in self._down)

    # -- what a policy provides ---------------------------------------------------------------------------------

    @abstractmethod
    def _pick(self, vertex: int, eligible: list[int], work: float) -> int:
        """Of the candidates of `vertex` at positions `eligible` (non-empty), the position to try next.

        `work` is the request's expected tokens (prompt + average output). A walk may be abandoned at a
        dead end and redone over fewer candidates, so state changes belong in `_commit`.
        """

    def _commit(self, steps: list[Step], work: float) -> None:
        """The pipeline is fixed: `steps` are the choices taken, each with the candidates it chose among."""
        return None  # stateless policies remember nothing

    def _node_name(self, vertex: int) -> str:
        return self._names[vertex] if vertex < self._sink else SINK

    # -- the walk -----------------------------------------------------------------------------------------------

    def _assign(self, request_id: str, input_len: int, waited: float) -> Decision | None:
        """Walk from SOURCE to SINK over unmasked nodes; commit and return the pipeline, or None.

        The walk goes forward, asking the policy at every vertex, and usually reaches SINK at once. If it
        runs into a dead end (every candidate masked), one backward pass over the DAG finds the vertices
        from which SINK is still reachable, and a second walk keeps to those: the same pipeline a
        depth-first search with backtracking would find (a policy picks the same best candidate among
        the live ones), at O(vertices + edges) at worst instead of a search that may wander the graph.
        """
        avg = self._output.mean
        need = input_len + avg  # the new request's own expected tokens
        steps = self._walk(need, avg, None)
        if steps is None:
            live = self._live(need, avg)
            if not live[self._source]:
                return None
            steps = self._walk(need, avg, live)
            assert steps is not None, "a live vertex always has a live candidate"
        self._commit(steps, need)
        cands, stages, kvp, kvn = self._cands, self._stages, self._kv_prompt, self._kv_requests
        vertices = tuple([cands[u][p] for u, _, p in steps[:-1]])
        for c in vertices:
            kvp[c] += input_len
            kvn[c] += 1
        pipeline = tuple([stages[u][p] for u, _, p in steps[:-1]])
        self._running[request_id] = _Running(vertices, input_len, pipeline)
        return Decision(request_id, pipeline, waited_s=waited)

    def _walk(self, need: float, avg: float, live: list[bool] | None) -> list[Step] | None:
        """One forward walk: over unmasked candidates, or only over `live` ones; None at a dead end."""
        kvp, kvn, limit, cands, sink = self._kv_prompt, self._kv_requests, self._limit, self._cands, self._sink
        steps: list[Step] = []
        v = self._source
        while v != sink:
            cs = cands[v]
            if live is None:
                eligible = [p for p, c in enumerate(cs) if kvp[c] + kvn[c] * avg + need <= limit[c]]
            else:
                eligible = [p for p, c in enumerate(cs) if live[c]]
            if not eligible:
                return None
            p = eligible[0] if len(eligible) == 1 else self._pick(v, eligible, need)
            steps.append((v, eligible, p))
            v = cs[p]
        return steps

    def _live(self, need: float, avg: float) -> list[bool]:
        """Per vertex: is it unmasked with some path of unmasked nodes to SINK? Sinks first, over the DAG."""
        kvp, kvn, limit, cands = self._kv_prompt, self._kv_requests, self._limit, self._cands
        live = [False] * (self._sink + 2)
        live[self._sink] = True
        for v in self._order:
            if kvp[v] + kvn[v] * avg + need <= limit[v]:
                for c in cands[v]:
                    if live[c]:
                        live[v] = True
                        break
        live[self._source] = any(live[c] for c in cands[self._source])
        return live

    def _release(self, running: _Running) -> None:
        for c in running.vertices:
            self._kv_prompt[c] -= running.input_len
            self._kv_requests[c] -= 1

    # -- static feasibility: could the request fit if nothing else were running? ---------------------------------

    def _bottleneck(self, *, capacity_limits: bool, down: bool) -> float:
        """The largest request (expected tokens) some pipeline could take on an idle cluster: max over paths
        of the min node limit; -inf when there is no path at all. DP over the DAG, sinks first."""
        best = [-math.inf] * (self._sink + 2)
        best[self._sink] = math.inf
        for v in self._order:
            if down and v in self._down:
                continue
            reach = max((best[c] for c in self._cands[v]), default=-math.inf)
            best[v] = min(reach, self._cap_limit[v]) if capacity_limits else reach
        return max((best[c] for c in self._cands[self._source]), default=-math.inf)

    def _refresh_bottlenecks(self) -> None:
        self._alive_path = self._bottleneck(capacity_limits=False, down=True) > -math.inf
        self._largest = self._bottleneck(capacity_limits=True, down=True)

    def _unservable(self, input_len: int) -> str:
        """Why no pipeline could ever take this request (even with nothing else running); "" if one could."""
        need = input_len + self._output.mean
        if need <= self._largest:
            return ""
        if not self._has_path:
            return (f"the plan has no pipeline: no chain of nodes from source to sink covers all "
                    f"{self.plan.num_layers} layers")
        if not self._alive_path:
            return f"no pipeline avoids the nodes that are down ({', '.join(sorted(self.down))})"
        return (f"the request needs about {need:.0f} tokens of KV ({input_len} prompt + {self._output.mean:.0f} "
                f"expected output) and no pipeline has room for more than {self._largest:.0f} under the "
                f"high-water mark")


class IwrrScheduler(PipelineScheduler):
    """Helix's scheduler (§5.1): at every vertex an interleaved weighted round-robin over its out-edges,
    weights equal to the max-flow solution's edge flows, nodes over the KV high-water mark masked (§5.2).

    The round-robin is *smooth* weighted round-robin (nginx's), rather than Tabatabaei's IWRR with its
    rounds of slots: it takes the float flows as they are (IWRR needs small integer weights, and quantizing
    flows like 517.3 : 9.8 either distorts the ratio or makes rounds so long that a node waits a whole round
    for its turn), it interleaves at least as well (3:1 gives A A B A, never A A A B), and each candidate's
    share stays within a constant of its flow's share at every point, not only at the end of a round.

    Each candidate keeps a credit. To route `work` tokens (prompt + average output, so that a long request
    counts for more, as flows are tokens/s): every eligible candidate gains work x its share of the eligible
    weight, the one with the most credit wins and pays `work`. Credits of eligible candidates sum to zero, so
    none runs ahead by more than a bounded amount. Masked candidates neither gain nor pay: a node coming back
    from the KV mask is not owed a burst. Ties go to the first candidate by name. `seed` is not used.
    """

    name = "iwrr"

    def __init__(self, plan: PlacementPlan, *, kv_capacity: Mapping[str, int] | None = None,
                 high_water: float = 0.9, avg_output_len: float = 240.0, queue_limit: int = 1024,
                 seed: int = 0, output_ratio: float = 1.0, learn_output: bool = True) -> None:
        super().__init__(plan, kv_capacity=kv_capacity, high_water=high_water, avg_output_len=avg_output_len,
                         queue_limit=queue_limit, seed=seed, edges="flows", output_ratio=output_ratio,
                         learn_output=learn_output)
        self._credit = [[0.0] * len(c) for c in self._cands]
        self._total = [sum(w) for w in self._weights]

    def _pick(self, vertex: int, eligible: list[int], work: float) -> int:
        credit, weights = self._credit[vertex], self._weights[vertex]
        total = self._total[vertex] if len(eligible) == len(weights) else sum(weights[p] for p in eligible)
        scale = work / total
        best, best_credit = eligible[0], -math.inf
        for p in eligible:
            c = credit[p] + weights[p] * scale
            if c > best_credit:
                best, best_credit = p, c
        return best

    def _commit(self, steps: list[Step], work: float) -> None:
        for v, eligible, chosen in steps:
            if len(eligible) < 2:
                continue  # gains work, pays work
            credit, weights = self._credit[v], self._weights[v]
            total = self._total[v] if len(eligible) == len(weights) else sum(weights[p] for p in eligible)
            scale = work / total
            for p in eligible:
                credit[p] += weights[p] * scale
            credit[chosen] -= work
