"""The simulated coordinator: the runtime's scheduler object decides, the simulator carries the tokens.

A request arrives; `scheduler.submit(id, input_len, now)` gives it a route (`Decision.route`, or queues or
refuses it). The coordinator then does what `hetnode.coordinator.sessions.PipelineGenerator` does over the
network: it sends the whole context's token ids to the first hop in one message (the nodes' batch policy
chunks it under their token budget). From then on the nodes run the request by themselves, as
`hetnode.node.hops` does: the last hop samples, feeds each token straight back to the first hop (a link message
from the last hop to the first) and streams it to the coordinator beside that (`at_last_hop`), stopping by
itself at the request's output length. The coordinator counts each token when it arrives (TTFT and TPOT are
measured there), tells the scheduler at a session's first token (`prefilled`: a phase-split scheduler frees the
prefill replica), and when the last one is in, every hop gets a Release (it frees the session's KV there, a
link latency later) and `scheduler.finish` may admit requests the scheduler had queued.

A route is one mixed phase (Helix), a prefill phase and a decode phase (Splitwise, ThunderServe), or Cronus's
partial prefill: a prefill phase of tokens [0, k) and a mixed phase from k. For the latter two the next phase's
hops reserve their KV first (`handoff.py`: the Install and Ready round trip, before the context goes out). After
a whole prefill, the prefill phase's last hop samples the first token, streams it here at once and hands it to
the decode phase's first hop, whose hops run once their KV has come. After a partial one, as the runtime's
coordinator sends each phase's first hop its part of the context (`phase_span`), [0, k) goes to the prefill
phase (a piece of the request, `SimRequest.piece`: its last hop samples nothing) and [k, n) to the mixed phase,
whose hops hold it until the KV of [0, k) has come, prefill it in chunks under their token budget beside their
decodes, sample the first token and decode. When every hop of the first phase has handed its KV on (its
HandedOver), the scheduler hears `partial_done` (Cronus frees the PPI's place then), as the coordinator tells it.

With a phase-split scheduler that books the decode KV at the hand-off (`decode_booking` "handoff", ThunderServe's
KV queues on the prefill replicas), the context goes out at admission and the prefill hops keep the KV they
compute; after the scheduler hears `prefilled`, it names the requests whose decode replica has room
(`take_handoffs`), and only then do the decode hops reserve (Install, Ready; a hop without room waits for it) and
the prefill hops send the KV they kept (`handoff.py`).

Token ids travel as 4 bytes per token (`TOKEN_BYTES`), on the links from the coordinator to the first hop, from
the last hop to the first, and from the last hop to the coordinator. By default the coordinator itself
takes no time. With `request_s` or `token_s` it is one server working in arrival order (the runtime's
coordinator is one event loop): starting a request (parsing it, routing it, sending its context) takes
`request_s`, handling one streamed token takes `token_s`; a token is counted when its turn is done. Neither is
on the nodes' per-token path any more.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple, Protocol

from hetnode.errors import HetnodeError
from hetnode.policy import Cause, Lifecycle
from hetnode.policy.decode_booking import HANDOFF
from hetnode.protocol.messages import Route
from hetnode.protocol.routes import describe, kv_targets, phase_span, pipeline_route, route_problem
from hetnode.testnet.sim.events import grouped
from hetnode.testnet.sim.handoff import RouteHandoff
from hetnode.testnet.sim.node import SimNode

# How long a request waits for a plan that can serve it: the coordinator's --route-wait default.
ROUTE_WAIT_S = 30.0


class SimulationError(HetnodeError):
    """The simulated system did something impossible (an invalid pipeline from the scheduler, ...)."""


class Decision(Protocol):
    @property
    def route(self) -> Route | None: ...
    @property
    def queued(self) -> bool: ...


class Scheduler(Protocol):
    """What the simulator needs of `hetnode.coordinator.scheduler`'s schedulers (their `prefilled(id, now)` and
    `partial_done(id, now)` are called too where a scheduler has them, as every runtime scheduler does)."""

    def submit(self, request_id: str, input_len: int, now: float) -> Any: ...

    def finish(self, request_id: str, output_len: int, now: float) -> Sequence[Any]: ...

    def cancel(self, request_id: str, now: float | None = None) -> Sequence[Any]: ...


class SimRequest:
    """A request, and the item of it in flight (the fields the batch policy reads: session, start, num_tokens,
    prefill_end). A piece split off a prompt chunk by a node's policy is a clone whose `origin` is the request."""

    __slots__ = ("admitted", "arrival", "booked_at", "decode_at", "depth", "done", "entry", "first", "first_token",
                 "gen", "handed", "handoff", "handoff_end", "hop_from", "hop_sent", "hops", "idx", "input_len", "kind",
                 "kv_out", "kv_since", "kv_wait", "last_token", "max_tbt", "num_tokens", "nxt", "origin", "output_len",
                 "path", "pf", "prefill_end", "prefilled_at", "pull", "ready", "received", "rejected", "restarts",
                 "rid", "route", "sched", "seg", "session", "start", "told")

    def __init__(self, idx: int, arrival: float, input_len: int, output_len: int) -> None:
        self.idx = idx
        self.rid = f"r{idx}"
        self.arrival = arrival
        self.input_len = input_len
        self.output_len = output_len
        self.admitted = -1.0  # when the scheduler gave it a pipeline
        self.first_token = -1.0
        self.last_token = -1.0
        self.done = -1.0
        self.max_tbt = 0.0  # the longest gap between two of its tokens
        self.kv_wait = 0.0  # time its prompt waited for KV memory at nodes
        self.kv_since = -1.0
        self.rejected = ""
        self.gen = 0  # tokens sampled by its last hop
        self.received = 0  # tokens the coordinator has received
        self.restarts = 0  # moves to another route (a node preempted it, had no room, or went down)
        # The scheduler that admitted (or queued) it: the one told when it ends or moves, as the runtime's
        # deployment keeps each session's (`Deployment.route_done`), whichever plan serves by then.
        self.sched: Any = None
        self.route: SimRoute | None = None  # the route it runs on
        self.origin = self
        self.session = -1  # the nodes' key for its KV; a new one for each pipeline it runs on
        # The item in flight: `num_tokens` tokens at positions [start, start + num_tokens); pf while it is a
        # prompt chunk, of the `prefill_end` tokens prefilled before decoding.
        self.start = 0
        self.num_tokens = 0
        self.pf = True
        self.prefill_end = input_len
        self.entry = -1  # index of the node the context goes to: the first phase's first hop
        self.first = -1  # index of the last phase's first hop (where each sampled token goes)
        self.nxt: dict[int, int] = {}  # node index -> the next hop's index (the coordinator after a phase's last)
        self.seg: dict[int, int] = {}  # node index -> its layer-range slot there
        self.hops: tuple[tuple[SimNode, int], ...] = ()  # (node, layers it runs there), every phase's
        self.depth = 0
        self.path = ""
        self.kind = PHASE_KIND  # the last phase's kind
        self.told = -1  # the session whose first token the scheduler has heard of
        # Phase-split routes (handoff.py): the route's hand-offs, this session's codec and transfer mode per link
        # (by prefill hop), decode hops not ready yet, when the prefill phase sampled the first token and when
        # the decode phase's first step began.
        self.handoff: RouteHandoff | None = None
        self.kv_out: dict[int, Any] | None = None
        self.ready = 0
        # Tokens whose KV the first phase hands on (the whole context after a whole prefill; k after Cronus's
        # partial one), and the first phase's hops that have handed theirs on so far (HandedOver).
        self.handoff_end = input_len
        self.handed = 0
        self.prefilled_at = -1.0
        self.decode_at = -1.0
        # When its decode hops' KV was booked (admission, or its hand-off's start with the scheduler's
        # decode_booking "handoff"), and whether this session's KV waits on its prefill hops for that ("handoff").
        self.booked_at = -1.0
        self.pull = False
        # Where and when the item was last sent (the sender's index, -1 once its step was counted), for SWARM's
        # per-link delays (`Simulation.hop_delays`).
        self.hop_from = -1
        self.hop_sent = 0.0

    def piece(self, k: int) -> SimRequest:
        """Split the item: a clone runs its first `k` tokens now; this request keeps the rest, at its place."""
        clone = SimRequest.__new__(SimRequest)
        for name in SimRequest.__slots__:
            setattr(clone, name, getattr(self, name))
        clone.num_tokens = k
        clone.kv_since = -1.0
        self.start += k
        self.num_tokens -= k
        return clone


class SimRoute:
    """One route, prepared once and shared (read-only) by every request the scheduler sends along it."""

    __slots__ = ("depth", "entry", "first", "handoff", "hops", "kind", "nxt", "path", "phases", "seg")

    def __init__(self, entry: int, first: int, nxt: dict[int, int], seg: dict[int, int],
                 hops: tuple[tuple[SimNode, int], ...], depth: int, path: str, kind: str,
                 handoff: RouteHandoff | None, phases: tuple[frozenset[str], ...] = ()) -> None:
        self.entry = entry
        self.first = first
        self.nxt = nxt
        self.seg = seg
        self.hops = hops  # (node, layers it runs), every phase's
        self.depth = depth  # hops of the last phase
        self.path = path
        self.kind = kind
        self.handoff = handoff
        self.phases = phases  # each phase's node names, in route order (what a node going down is checked against)


class SimToken:
    """One sampled token on its way from a last hop to the coordinator (a snapshot: the request goes on)."""

    __slots__ = ("r", "session")
    pf = False  # what a link message's accounting reads of its items
    num_tokens = 1

    def __init__(self, r: SimRequest) -> None:
        self.r = r
        self.session = r.session


class _Hooks(NamedTuple):
    prefilled: Callable[[str, float], Sequence[Any]] | None
    partial_done: Callable[[str, float], Sequence[Any]] | None
    take_handoffs: Callable[[], list[str]] | None


# A one-phase route prefills and decodes on the same pipeline (Helix's); phase-split ones hand KV over.
PHASE_KIND = "mixed"
PREFILL = "prefill"
Send = Callable[[int, int, list[Any], float], None]
Push = Callable[[float, int, Any, Any], None]


class Installer(Protocol):
    """What starts a phase-split session (`handoff.SimHandoff`): its decode hops reserve, then each answers
    `on_ready` or `on_full`."""

    def install(self, r: SimRequest, now: float) -> None: ...

    def queue(self, r: SimRequest, now: float) -> None: ...

    def pull(self, r: SimRequest, now: float) -> None: ...

    def push(self, r: SimRequest, now: float) -> None: ...

    def reprefills(self, route: Route, tokens: int) -> bool: ...


class SimCoordinator:
    def __init__(self, scheduler: Scheduler, nodes: Sequence[SimNode], *, num_layers: int, send: Send,
                 send_ids: Send, release: Callable[[SimNode, int, float], None], block_size: int,
                 window: tuple[float, float], bin_s: float, request_s: float = 0.0, token_s: float = 0.0,
                 max_reroutes: int = 3, lifecycle: Lifecycle | None = None,
                 handoff: Installer | None = None, route_wait_s: float = ROUTE_WAIT_S) -> None:
        if not request_s >= 0 or not token_s >= 0:
            raise ValueError(f"the coordinator's times must be >= 0, not {request_s} and {token_s}")
        # The scheduler of the plan that serves: new requests and moves go to it. A re-plan (replan.py) replaces
        # it; the requests an older one admitted finish on their routes and end in it (`SimRequest.sched`).
        self.scheduler = scheduler
        self._hooks: dict[int, _Hooks] = {}
        self.pulling: dict[str, SimRequest] = {}  # prefilling or waiting for their hand-off to start
        self.handoff = handoff
        self.nodes = nodes
        self.by_name = {n.name: n for n in nodes}
        self.index = len(nodes)  # the coordinator's endpoint index
        self.num_layers = num_layers
        self.send = send
        self.send_ids = send_ids  # token ids from a last hop to a first hop
        self.release = release
        self.block = block_size
        # The runtime's policy: when to sample, stop, move or give up (another design passes its own).
        self.lifecycle = lifecycle or Lifecycle(max_reroutes)
        self.sessions = 0  # session ids handed out
        self.preemptions = 0  # moves after a node preempted a request, or had no KV room for it
        self.lost_moves = 0  # moves after a node of the request's route went down
        # A re-plan's scheduler while its nodes get ready (masks nodes that go down meanwhile, as the runtime's
        # deployment masks them in its newest plan too), and how the simulation drops moved requests' items.
        self.pending: Scheduler | None = None
        self.purge: Callable[[set[int]], None] | None = None
        # Requests waiting for a plan that can serve them, and how the simulation ends the wait (replan.py).
        self.held: dict[str, SimRequest] = {}
        self.route_wait_s = route_wait_s
        self.expire: Callable[[float, SimRequest], None] | None = None
        # Set at the first refusal: items of a refused request may still be on links; nodes drop them on arrival
        # (the runtime's batch loop drops work of released sessions the same way).
        self.stragglers = False
        self.window = window
        self.bin_s = bin_s
        self.routes: dict[tuple[Any, ...], SimRoute] = {}
        self.requests: list[SimRequest] = []  # every request that arrived, in arrival order
        self.waiting: dict[str, SimRequest] = {}  # queued by the scheduler
        self.inflight = 0  # admitted and not finished
        self.finished = 0
        self.on_finish: Callable[[float], None] | None = None  # the offline workload's closed loop
        self.on_token: Callable[[float], None] | None = None  # Helix's offline loop: called per token counted
        self.on_first: Callable[[float], None] | None = None  # ... or at a request's first token (prompt done)
        # Tokens over time and inside the measured window.
        self.decode_bins: list[float] = []  # tokens generated per bin
        self.prompt_bins: list[float] = []  # prompt tokens whose prefill completed per bin
        self.window_generated = 0
        self.window_prompt = 0
        # Every gap between two tokens of a request that ended inside the window: Helix's decode latency is
        # their mean (a per-step average, so long requests weigh more than in the per-request TPOT).
        self.decode_gaps: list[float] = []
        # The coordinator as one server: seconds to start a request and to handle one returned item, and when
        # it is next free.
        self.request_s = request_s
        self.token_s = token_s
        self.free = 0.0

    # -- admission --------------------------------------------------------------------------------------

    def hooks(self, scheduler: Scheduler) -> _Hooks:
        """What a scheduler is told beyond submit, finish and cancel, where it has it (every runtime scheduler does):
        a session's first token, its earlier phases done, and (a phase-split scheduler that books the decode KV at
        the hand-off, decode_booking "handoff") the requests whose hand-off may start now."""
        found = self._hooks.get(id(scheduler))
        if found is None:
            pull = getattr(scheduler, "decode_booking", "") == HANDOFF
            found = self._hooks[id(scheduler)] = _Hooks(
                getattr(scheduler, "prefilled", None), getattr(scheduler, "partial_done", None),
                getattr(scheduler, "take_handoffs", None) if pull else None)
        return found

    def arrive(self, r: SimRequest, now: float) -> None:
        self.requests.append(r)
        self._submit(r, r.input_len, now)

    def _submit(self, r: SimRequest, context: int, now: float) -> None:
        """Ask the serving plan's scheduler for a route of `context` tokens. While it can serve nothing (every
        replica of a phase down, its re-plan loading) the request waits for a plan that can, at most
        `route_wait_s`, as the runtime's `Deployment.route` waits (`--route-wait`); only in a run with losses or
        a re-plan (`expire` set): elsewhere the scheduler's refusal stands, as it always has here."""
        scheduler = self.scheduler
        if self.expire is not None and getattr(scheduler, "largest_kv", 0.0) == -math.inf:
            self.held[r.rid] = r
            self.expire(now + self.route_wait_s, r)
            return
        self._decided(r, scheduler.submit(r.rid, context, now), now, scheduler)

    def expired(self, r: SimRequest, now: float) -> None:
        """A request held for a usable plan waited `route_wait_s` in vain: it ends, as the runtime answers 503."""
        if self.held.pop(r.rid, None) is None:
            return
        r.rejected = f"no pipeline is ready to serve within {self.route_wait_s:g} s"
        if self.on_finish is not None:
            self.on_finish(now)

    def _decided(self, r: SimRequest, decision: Any, now: float, scheduler: Scheduler) -> None:
        route = decision.route
        if route is not None:
            r.sched = scheduler
            self._start(r, route, now)
        elif decision.queued:
            r.sched = scheduler
            self.waiting[r.rid] = r
        else:
            r.rejected = str(getattr(decision, "reason", "") or "refused by the scheduler")

    def _start(self, r: SimRequest, decided: Route, now: float) -> None:
        if (self.handoff is not None and len(decided.phases) == 2 and self.handoff.reprefills(
                decided, self.lifecycle.restart(r.input_len, r.gen, r.output_len).prefill_end)):
            decided = pipeline_route(decided.phases[1].hops)  # the decode side recomputes it, sooner
        phases = decided.phases
        if len(phases) == 1:
            key: tuple[Any, ...] = tuple((h.peer, h.first_layer, h.last_layer) for h in phases[0].hops)
        else:  # the route's shape: a partial prefill's k is the request's, not the route's
            key = tuple((p.kind, p.first_token is None, p.last_token is None,
                         tuple((h.peer, h.first_layer, h.last_layer) for h in p.hops)) for p in phases)
        route = self.routes.get(key)
        if route is None:
            route = self.routes[key] = self._route(decided)
        if r.admitted < 0:
            r.admitted = now
        r.route = route
        r.entry = route.entry
        r.first = route.first
        r.nxt = route.nxt
        r.seg = route.seg
        r.depth = route.depth
        r.path = route.path
        r.hops = route.hops
        r.kind = route.kind
        r.handoff = route.handoff
        r.handed = 0
        # A fresh session: after a move the new pipeline prefills the prompt and every token generated so far
        # (as SessionCursor.restart), then samples the next token.
        r.session = self.sessions
        self.sessions += 1
        r.pf = True
        r.start = 0
        r.prefill_end = self.lifecycle.restart(r.input_len, r.gen, r.output_len).prefill_end
        r.num_tokens = r.prefill_end  # the whole context: the first hop's policy chunks it
        # Where the first phase ends, as the runtime's coordinator splits the context (`phase_span`).
        end = phase_span(decided, 0, r.prefill_end)[1] if len(phases) > 1 else None
        r.handoff_end = r.prefill_end if end is None else end
        self.inflight += 1
        if self.request_s:
            now = self.free = max(self.free, now) + self.request_s
        if r.handoff is None:
            r.kv_out = None  # (a request moved off a phase-split route hands nothing on here)
            self.send(self.index, r.entry, [r], now)
            return
        # Phase-split: the decode hops reserve the KV first; the context goes out when all are ready.
        if self.handoff is None:
            raise SimulationError("a phase-split route, but the simulation models no KV hand-offs")
        r.pull = False
        if self.hooks(r.sched).take_handoffs is not None and r.handoff_end == r.prefill_end:
            # Booked at the hand-off: the context goes out now; the KV waits on the prefill hops (`handoff.queue`).
            r.booked_at = -1.0
            self.pulling[r.rid] = r
            self.handoff.queue(r, now)
            self.send(self.index, r.entry, [r], now)
            return
        r.booked_at = now
        self.handoff.install(r, now)

    def on_ready(self, r: SimRequest, session: int, now: float) -> None:
        """A decode hop reserved the session's KV (Ready); the last one lets the context go to the first hop."""
        if r.session != session or r.done >= 0 or r.rejected:
            return
        r.ready -= 1
        if r.ready:
            return
        if r.pull:
            assert self.handoff is not None
            self.handoff.push(r, now)  # the prefill hops send the KV they kept
        else:
            self._send_context(r, now)

    def _send_context(self, r: SimRequest, now: float) -> None:
        """Each phase's first hop gets its part of the context (the runtime's `phase_span`): after a partial
        prefill's Ready, [0, k) to the first phase and [k, n) to the next, at once; else all of it to the first."""
        k = r.handoff_end
        if 0 < k < r.prefill_end:
            piece = r.piece(k)  # [0, k); the request itself keeps [k, n) and goes on to decode
            self.send(self.index, r.entry, [piece], now)
            self.send(self.index, r.first, [r], now)
            return
        self.send(self.index, r.entry, [r], now)

    def on_handed(self, r: SimRequest, session: int, now: float) -> None:
        """A first-phase hop's HandedOver: every hop of it is done with the session once the last one says so,
        and the scheduler hears it (`partial_done`), as the runtime's coordinator tells it."""
        if r.session != session or r.done >= 0 or r.rejected or r.handoff is None:
            return
        r.handed += 1
        if r.handed < len(r.handoff.sources):
            return
        if r.handoff_end < r.prefill_end:
            r.prefilled_at = now  # a partial prefill samples nothing: its phase ends with the last hand-over
        partial_done = self.hooks(r.sched).partial_done
        if partial_done is not None:
            self._admit_queued(partial_done(r.rid, now), now, r.sched)

    def on_full(self, r: SimRequest, session: int, reason: str, now: float) -> None:
        """A decode hop had no KV memory free for the session (Failed, cause "full"): the lifecycle decides."""
        if r.session == session:
            self.on_failed([(r, reason, "full")], now)

    def _route(self, route: Route) -> SimRoute:
        """The scheduler's route, checked by the rules every hop checks an Install against, as the simulator runs
        it: one mixed phase, or a prefill phase then a decode phase on other nodes, or a partial prefill [0, k)
        then a mixed phase from k on other nodes (Cronus)."""
        what = describe(route)
        problem = route_problem(route, self.num_layers)
        if problem:
            raise SimulationError(f"the scheduler's route {what} is not one the hops accept (every layer once, in "
                                  f"order, per phase): {problem}")
        phases = route.phases
        two = len(phases) == 2 and phases[0].kind == PREFILL
        partial = two and phases[0].last_token is not None and phases[1].kind == PHASE_KIND
        split = two and (phases[1].kind == "decode" or partial)
        if len(phases) > 1 and not split:
            raise SimulationError(f"the scheduler's route {what}: the simulator runs one mixed phase, a prefill "
                                  f"phase then a decode phase, or a partial prefill then a mixed phase")
        nxt: dict[int, int] = {}
        seg: dict[int, int] = {}
        hops: list[tuple[SimNode, int]] = []
        starts: list[int] = []
        lasts: list[int] = []
        for phase in phases:
            nodes: list[SimNode] = []
            for h in phase.hops:
                node = self.by_name.get(h.peer)
                if node is None:
                    raise SimulationError(f"the scheduler's route {what} names node {h.peer!r}, which holds no layers")
                if node.index in seg:  # a hop refuses a route that names it twice
                    raise SimulationError(f"the scheduler's route {what} visits {h.peer} twice")
                nodes.append(node)
                seg[node.index] = node.slot(h.first_layer, h.last_layer)
                hops.append((node, h.last_layer - h.first_layer))
            for i, node in enumerate(nodes):
                nxt[node.index] = nodes[i + 1].index if i + 1 < len(nodes) else self.index
                node.add_next_hop(nxt[node.index])
            starts.append(nodes[0].index)
            lasts.append(nodes[-1].index)
        handoff = None
        if split:
            sources = {}
            for h in phases[0].hops:
                src = self.by_name[h.peer]
                src.kv_out = True
                targets = tuple((self.by_name[t.peer].index, t.first_layer - h.first_layer,
                                 t.last_layer - h.first_layer, t.codec if phases[0].kv_links else "")
                                for t in kv_targets(route, 0, h))
                sources[src.index] = (h.last_layer - h.first_layer, targets)
            receivers = {self.by_name[h.peer].index: h.last_layer - h.first_layer for h in phases[1].hops}
            handoff = RouteHandoff(lasts[0], sources, receivers)
        path = " | ".join(">".join(f"{h.peer}[{h.first_layer},{h.last_layer})" for h in phase.hops)
                          for phase in phases)
        return SimRoute(starts[0], starts[-1], nxt, seg, tuple(hops), len(phases[-1].hops), path, phases[-1].kind,
                        handoff, tuple(frozenset(h.peer for h in phase.hops) for phase in phases))

    # -- the last hop: the decode loop runs on the nodes ------------------------------------------

    def at_last_hop(self, node: int, items: list[SimRequest], now: float) -> None:
        """A last hop finished a step: sample, feed every request that goes on back to its first hop, and
        stream the step's tokens to the coordinator (one message), as `HopServer._deliver` does."""
        tokens: list[SimToken] = []
        going: list[SimRequest] = []
        samples = self.lifecycle.samples
        after_token = self.lifecycle.after_token
        for r in items:
            end = r.start + r.num_tokens
            if r.done >= 0 or r.rejected or not samples(end, r.prefill_end):
                continue  # a request already ended, or a piece of a split prompt chunk (its last piece samples)
            r.start = end  # the sampled token's position: the next decode item starts there
            if r.pf:
                r.pf = False
                r.num_tokens = 1
            r.gen += 1
            tokens.append(SimToken(r))
            kind = r.kind
            if r.handoff is not None and node == r.handoff.last:
                kind = PREFILL  # the prefill phase's last hop: the first token goes on to the decode phase
                r.prefilled_at = now
            # A runtime route counts from its own start against what is left of max_tokens (its Install); both
            # counts here are from the request's start, which shifts both sides of the comparison alike.
            then = after_token(kind, r.gen, r.output_len, False)
            if then != "end":  # "loop" to this phase's first hop, or "handoff" to the decode phase's: r.first
                going.append(r)
        if tokens:
            self.send(node, self.index, tokens, now)
        if not going:
            return
        firsts = [r.first for r in going]
        f = firsts[0]
        if firsts.count(f) == len(firsts):
            self.send_ids(node, f, going, now)
            return
        for f, out in grouped(firsts, going).items():
            self.send_ids(node, f, out, now)

    def on_message(self, tokens: list[SimToken], now: float) -> None:
        """Tokens streamed from a last hop: count them, and end the requests whose last token this is."""
        token_s = self.token_s
        if not token_s:
            self._handle(tokens, now)
            return
        for t in tokens:  # one at a time, each when the coordinator has handled everything before it
            self.free = done = max(self.free, now) + token_s
            self._handle([t], done)

    def _handle(self, tokens: list[SimToken], now: float) -> None:
        produced = 0
        prompt_done = 0
        for t in tokens:
            r = t.r
            if r.done >= 0 or r.rejected or t.session != r.session:
                continue  # ended, or a token of a session the request has moved away from
            produced += 1
            r.received += 1
            if t.session != r.told:  # the session's first token: its prefill is done (the runtime's route_prefilled)
                r.told = t.session
                prefilled = self.hooks(r.sched).prefilled
                if prefilled is not None:
                    self._admit_queued(prefilled(r.rid, now), now, r.sched)
            if r.first_token < 0:
                r.first_token = r.last_token = now
                prompt_done += r.input_len
            else:
                gap = now - r.last_token
                if gap > r.max_tbt:
                    r.max_tbt = gap
                r.last_token = now
                if self.window[0] <= now < self.window[1]:
                    self.decode_gaps.append(gap)
            ended = self.lifecycle.ends(r.received, r.output_len, False)
            if ended:
                self._finish(r, now)
            if self.on_token is not None:
                self.on_token(now)
            if self.on_first is not None and r.received == 1 and not ended:
                self.on_first(now)
        if produced:
            self._count(now, produced, prompt_done)

    def _count(self, now: float, produced: int, prompt_done: int) -> None:
        b = int(now / self.bin_s)
        bins = self.decode_bins
        if b >= len(bins):
            bins.extend([0.0] * (b + 1 - len(bins)))
            self.prompt_bins.extend([0.0] * (b + 1 - len(self.prompt_bins)))
        bins[b] += produced
        self.prompt_bins[b] += prompt_done
        lo, hi = self.window
        if lo <= now < hi:
            self.window_generated += produced
            self.window_prompt += prompt_done

    def _finish(self, r: SimRequest, now: float) -> None:
        r.done = now
        self.inflight -= 1
        self.finished += 1
        for node, _ in r.hops:
            self.release(node, r.session, now)
        self._admit_queued(r.sched.finish(r.rid, r.received, now), now, r.sched)
        if self.on_finish is not None:
            self.on_finish(now)

    def _admit_queued(self, decisions: Sequence[Any], now: float, scheduler: Scheduler) -> None:
        """What `scheduler` decided for requests it had queued (started or refused); then the hand-offs it lets
        start."""
        for decision in decisions:
            queued = self.waiting.pop(decision.request_id, None)
            if queued is not None:
                self._decided(queued, decision, now, scheduler)
        take_handoffs = self.hooks(scheduler).take_handoffs
        if take_handoffs is not None:
            for rid in take_handoffs():
                r = self.pulling.pop(rid, None)
                if r is not None and r.pull and r.done < 0 and not r.rejected:
                    assert self.handoff is not None
                    r.booked_at = now
                    self.handoff.pull(r, now)

    # -- failures at nodes ------------------------------------------------------------------------------

    def on_failed(self, failed: list[tuple[SimRequest, str, Cause]], now: float) -> None:
        """Requests a node refused (a prompt larger than its whole KV pool) or preempted (out of KV with nothing
        able to run). As PipelineGenerator does on Failed: release the session on every hop and move
        the request to a new pipeline (here: the scheduler's pick, re-prefilling what it had), at most
        `max_reroutes` times. A refused prompt ends there. The failure reaches the coordinator at once (it is
        rare; a message's latency would change nothing that matters)."""
        for item, reason, cause in failed:
            r = item.origin
            if r.done >= 0 or r.rejected or item.session != r.session:
                continue  # already ended or moved: a straggler of the old session
            self.inflight -= 1
            for node, _ in r.hops:
                self.release(node, r.session, now)
            r.session = -1
            admitted_by = r.sched
            decisions = list(admitted_by.cancel(r.rid, now))
            if not self.lifecycle.moves(cause, r.restarts):
                r.rejected = reason if cause == "refused" else f"{reason}; gave up after {r.restarts} moves"
                # The rest of a split chunk may wait at other hops: it must not take KV there again.
                for node, _ in r.hops:
                    node.queue = [x for x in node.queue if x.origin is not r]
                self.stragglers = True
            else:
                if cause == "lost":
                    self.lost_moves += 1
                else:
                    self.preemptions += 1
                r.restarts += 1
                r.kv_since = -1.0
                # The new pipeline re-prefills what the coordinator has received; tokens still on their way from
                # the old session are dropped when they arrive, and sampled again.
                r.gen = r.received
                restart = self.lifecycle.restart(r.input_len, r.gen, r.output_len)
                self._submit(r, restart.prefill_end, now)
            self._admit_queued(decisions, now, admitted_by)
            if r.rejected and self.on_finish is not None:
                self.on_finish(now)

    # -- nodes going down, and a new plan -------------------------------------------------------------------

    def node_down(self, names: Collection[str], now: float, why: str, *, lost: bool = True) -> list[SimRequest]:
        """Nodes went down (`lost`), or dropped their shard for a re-plan: as the runtime's coordinator does, the
        schedulers of the plans in use mask them (a dropped shard only in the serving plan's: the new plan has
        the node, with its new shard; the queued requests nothing can serve now are refused), and
        every running request whose route they fail (`Lifecycle.fails_when_down`) moves for cause "lost": its
        items still anywhere in the simulation are dropped (`purge`: the runtime's hops drop a released session's
        work), its KV released on its old hops, and a route asked of the serving plan's scheduler. Returns the
        requests that moved (or ended, past their last move)."""
        for scheduler in (self.scheduler, self.pending if lost else None):
            if scheduler is None or not hasattr(scheduler, "node_down"):
                continue
            for name in names:
                self._admit_queued(list(scheduler.node_down(name, now).rejected), now, scheduler)
        fails = self.lifecycle.fails_when_down
        failing = [r for r in self.requests
                   if r.route is not None and r.done < 0 and not r.rejected and r.session >= 0
                   and any(fails(name, r.route.phases, left=False) for name in names)]
        if failing:
            if self.purge is None:
                raise SimulationError("nodes went down, but the simulation cannot drop their requests' items")
            self.purge({id(r) for r in failing})
            self.on_failed([(r, why, "lost") for r in failing], now)
        return failing

    def switch(self, scheduler: Scheduler, now: float) -> int:
        """A new plan serves (every node of it ready), as `Deployment.on_status` switches: its scheduler takes
        new requests and moves; requests the old one admitted finish on their routes and end in it; those it had
        queued retry on the new plan (`Deployment._retire`: each is cancelled there, what the cancel lets in
        ignored, and submitted anew). Returns how many retried."""
        old, self.scheduler = self.scheduler, scheduler
        self.pending = None
        self.routes.clear()  # the route shapes of the old plan may name nodes that hold other layers now
        retried = 0
        for rid, r in list(self.waiting.items()):
            if r.sched is not old or self.waiting.get(rid) is not r:
                continue
            old.cancel(rid, now)
            del self.waiting[rid]
            retried += 1
            context = self.lifecycle.restart(r.input_len, r.gen, r.output_len).prefill_end
            self._decided(r, scheduler.submit(rid, context, now), now, scheduler)
        held, self.held = self.held, {}
        for r in held.values():  # those that waited for a plan that can serve
            retried += 1
            self._submit(r, self.lifecycle.restart(r.input_len, r.gen, r.output_len).prefill_end, now)
        return retried
