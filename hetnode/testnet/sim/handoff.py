"""KV hand-offs between a route's phases: the decode side's reservation, the codec per link, the transfers.

A phase-split route (Splitwise, ThunderServe: a prefill phase, then a decode phase on other nodes; Cronus: a
partial prefill of [0, k), then a mixed phase from k) runs here as `hetnode.node.hops` runs it, with the
runtime's own decisions:

- Install. Before the context goes out, every hop of the next phase reserves KV for the tokens handed to it (the
  whole context, or Cronus's k: its phase's start, `phase_span`) in its ledger (`KVLedger.reserve`, as
  `BatchLoop.reserve` does) when the coordinator's Install reaches it (one link latency), and answers Ready (one
  more); the coordinator sends the context when every hop is ready. A hop without room answers Failed with cause
  "full", and `Lifecycle` decides what follows, as for any failure. (Cronus's [k, n) then grows the reservation
  chunk by chunk under the hop's batch policy, as any prompt does.)
- Codec. Each link of the hand-off (a prefill hop to a decode hop that holds some of its layers: the runtime's
  `kv_targets`) gets the codec that `KVCodecPolicy` picks from the link's bandwidth and latency, the KV's exact
  packed size (`packed_size`) for the layers it carries and the whole context's tokens, and the codecs' pack
  and unpack rates, once per session when it starts, as `PipelineGenerator.with_codecs` picks them. The rates
  are those the nodes measure (`hetnode.kv.codec_rates.measure`, on this machine, for the model's KV shape)
  unless given; every node has the same. On a cluster of GPUs (the runner decides) they are instead those of
  memory-bound kernels at the slowest device's bandwidth (`device_rates`): this CPU's rates would have an
  emulated DGX spend seconds packing what its GPUs pack in a millisecond.
- Transfer. After each prefill step a hop sends the KV its step computed, each layer to the hop that holds it,
  over the simulated links (alpha-beta and FIFO, queued with the links' other traffic):

  * "whole", the runtime's way today: when the step's results have gone on, the hop packs every session's KV of
    the step (its worker is busy meanwhile: the next step waits) and then sends one message per session and
    target;
  * "layerwise": the step's layers are taken to finish evenly over its time, layer i of L at
    t0 + (i + 1) / L x step; each layer is packed when it is done (by a packer beside the compute, one layer
    after the other) and leaves at once, one message per layer and target for all the step's sessions, so the
    transfer overlaps the rest of the step.

  Which one a link uses is a pluggable choice (`TransferMode`: a callable of the link's `KVTransfer`, asked once
  per session and link); the default sends every link layer by layer.
- Arrival. The receiving hop unpacks each message in arrival order (an unpacker beside its compute: on the
  testnet the unpacking runs while the hop's emulated step sleeps; on a GPU it is a small kernel) and holds the
  session's items until every layer it holds has the KV handed to it. Its first decode step (Cronus: its first
  chunk of [k, n)) then runs on the next phase's pipeline; the prefill hop frees the session's KV once the last
  of it has left, and tells the coordinator (HandedOver, one link latency), which tells the scheduler
  (`partial_done`) once every hop of the prefill phase has.

- Booked at the hand-off (the scheduler's decode_booking "handoff": ThunderServe's KV queues, the prefill
  replicas' memory their buffer). The context goes out at once (`queue`: the decode hops only learn to hold the
  session's items until its KV comes); the prefill hops compute the KV and keep it. When the scheduler lets the
  hand-off start (`pull`, after the prefill), each decode hop reserves; one without room waits, in arrival
  order per hop, until a release frees enough (never a failure), and answers Ready then. When every decode
  hop is ready the coordinator tells the prefill hops (`push`, one link latency); each packs the session's KV from
  its cache layer after layer, on the packer beside its compute, every link alike (the KV is all there: there
  is nothing left to overlap with the prefill, and the hop's worker is not held), and frees it once the last
  layer has left (HandedOver, as above).

What the model leaves out: a layer-wise message that left before the end of its step is put on its link when the
step ends, so it queues behind messages sent on that link during the step; the unpacker takes messages in the
order their last byte arrives.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from hetnode.planner.model import ModelSpec
from hetnode.policy.kv_codec import AUTO, HandoffLink, KVCodecPolicy, LinkEstimate, choose_handoff, reprefill_seconds
from hetnode.policy.kv_transfer import KVTransferPolicy
from hetnode.policy.reservation_queue import ReservationQueue
from hetnode.protocol.kv_wire import packed_size
from hetnode.protocol.messages import CodecName, Route
from hetnode.protocol.routes import kv_targets
from hetnode.testnet.sim.events import RELEASE

if TYPE_CHECKING:
    from hetnode.testnet.sim.core import Simulation
    from hetnode.testnet.sim.node import SimNode

WHOLE = "whole"
LAYERWISE = "layerwise"
POLICY = "policy"  # what the runtime's hops do: KVTransferPolicy picks per link from its size and bandwidth
TRANSFER_MODES = (POLICY, WHOLE, LAYERWISE)
# A link this fast is, to the codec policy, as good as unlimited (its estimate needs a finite bandwidth).
_UNLIMITED_BPS = 1e15

Rates = Mapping[str, tuple[float, float]]  # codec -> (pack, unpack) in bytes of fp16 KV per second


def device_rates(bandwidth: float) -> Rates:
    """Pack and unpack rates on a device of `bandwidth` bytes/s of achieved memory bandwidth: each is one pass
    that reads the KV in one form and writes it in the other, so a codec whose packed size is r times fp16's
    moves 1 + r bytes per byte of fp16 KV, and runs at bandwidth / (1 + r) bytes of fp16 KV per second."""
    if not 0 < bandwidth < math.inf:
        raise ValueError(f"bandwidth must be positive and finite, not {bandwidth}")
    fp16 = packed_size("fp16", 1, 64, 1, 64)
    out = {}
    for name in get_args(CodecName):
        rate = bandwidth / (1 + packed_size(name, 1, 64, 1, 64) / fp16)
        out[name] = (rate, rate)
    return out


@dataclass(frozen=True, slots=True)
class KVTransfer:
    """One link of one session's hand-off: what a transfer-mode choice decides on."""

    src: str
    dst: str
    codec: str
    layers: int
    tokens: int
    fp16_bytes: int
    wire_bytes: int
    bandwidth: float  # bytes per second (inf: unlimited)
    latency: float  # seconds, one way


TransferMode = Callable[[KVTransfer], str]


def transfer_mode(choice: str | TransferMode) -> TransferMode:
    """The runtime's policy ("policy"), a fixed mode by name ("whole", "layerwise"), or the callable itself."""
    if callable(choice):
        return choice
    if choice not in TRANSFER_MODES:
        raise ValueError(f"kv transfer must be one of {', '.join(TRANSFER_MODES)} or a callable, not {choice!r}")
    if choice == POLICY:
        return policy_mode(KVTransferPolicy())
    return (lambda _: WHOLE) if choice == WHOLE else (lambda _: LAYERWISE)


def policy_mode(policy: KVTransferPolicy) -> TransferMode:
    """The hops' choice (`KVTransferPolicy`), from the transfer's wire bytes per token and layer and the link's
    bandwidth, as a prefill hop asks it for a step's hand-off to one target."""
    def choose(t: KVTransfer) -> str:
        mbps = t.bandwidth * 8 / 1e6 if math.isfinite(t.bandwidth) else None
        return policy.choose(t.tokens, t.layers, t.wire_bytes / (t.tokens * t.layers), mbps).mode

    return choose


class RouteHandoff:
    """Who hands whom which layers on one route, by node index (read-only, shared by the route's requests).

    sources: each prefill hop's layer count and targets (decode hop, first and last offset in the prefill hop's
    layers, the codec the route names for the link or ""); receivers: each decode hop's layer count; last: the
    prefill phase's last hop, which samples the first token and hands the session over."""

    __slots__ = ("last", "receivers", "sources")

    def __init__(self, last: int, sources: dict[int, tuple[int, tuple[tuple[int, int, int, str], ...]]],
                 receivers: dict[int, int]) -> None:
        self.last = last
        self.sources = sources
        self.receivers = receivers


# A prefill hop's plan for one session: its layer count, and per target (decode hop, first and last offset in
# its layers, codec, transfer mode).
Plan = tuple[int, tuple[tuple[int, int, int, str, str], ...]]


class StepKV:
    """What one prefill step hands over, between `step_done` and `send`: layer-wise messages that leave after
    the step's end ((departure, target, bytes, sessions, unpack seconds) each), the arrivals and sessions per
    target so far, the whole transfers ((session, target, layers, tokens, codec, fp16 bytes) each), and the
    sessions whose last KV at the hop this step computed (with their requests)."""

    __slots__ = ("chunks", "entries", "finals", "late", "whole")

    def __init__(self) -> None:
        self.late: list[tuple[float, int, int, int, float]] = []
        self.chunks: dict[int, list[tuple[float, float]]] = {}
        self.entries: dict[int, list[tuple[int, int]]] = {}
        self.whole: list[tuple[int, int, int, int, str, int]] = []
        self.finals: list[tuple[int, Any]] = []


class SimHandoff:
    """The hand-off's executor: registers its event kinds with the simulation and keeps the totals."""

    def __init__(self, sim: Simulation, model: ModelSpec, *, codec: str = AUTO,
                 transfer: str | TransferMode = LAYERWISE, rates: Rates | None = None) -> None:
        self.sim = sim
        self.nodes = sim.nodes
        self.by_name = {n.name: n for n in sim.nodes}
        self.policy = KVCodecPolicy(codec)  # the operator's --kv-codec, as the runtime's coordinator takes it
        self.mode = transfer_mode(transfer)
        self._rates = None if rates is None else dict(rates)
        self.kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self._sizes: dict[tuple[str, int, int], int] = {}
        self._plans: dict[tuple[RouteHandoff, int], dict[int, Plan]] = {}
        # Totals for the report.
        self.wire_bytes: dict[str, float] = {}  # codec -> bytes on the wire
        self.fp16_bytes: dict[str, float] = {}  # codec -> the same KV at fp16
        self.transfers: dict[str, int] = {}  # codec -> transfers (a session, a link, a prefill step)
        self.messages = 0
        self.installs = 0
        self.full = 0  # installs refused for want of KV memory
        # Booked at the hand-off: per decode hop, the sessions waiting for KV room to reserve (the queue a node's
        # batch loop runs too).
        self.waiting: dict[int, ReservationQueue[tuple[Any, int]]] = {}
        self.pulls = 0
        self.INSTALL = sim.register(self._install)
        self.READY = sim.register(self._ready)
        self.FULL = sim.register(self._full)
        self.KV_IN = sim.register(self._kv_in)
        self.KV_DONE = sim.register(self._kv_done)
        self.UNBLOCK = sim.register(self._unblock)
        self.HANDED = sim.register(self._handed)
        self.PUSH = sim.register(self._push)

    # -- what the runtime's coordinator decides when a session starts -------------------------------------------

    @property
    def rates(self) -> Rates:
        if self._rates is None:
            # Measured as a node measures them when it loads a shard (torch: only a run with hand-offs and no
            # given rates pays for the import and the few milliseconds of measuring).
            from hetnode.kv import codec_rates

            self._rates = codec_rates.measure(self.kv_heads, self.head_dim)
        return self._rates

    def size(self, codec: str, layers: int, tokens: int) -> int:
        key = (codec, layers, tokens)
        found = self._sizes.get(key)
        if found is None:
            found = self._sizes[key] = packed_size(codec, layers, tokens, self.kv_heads, self.head_dim)
        return found

    def codec(self, src: SimNode, dst: SimNode, layers: int, tokens: int) -> str:
        """The link's codec, as the runtime's coordinator picks it (`choose_handoff`)."""
        return choose_handoff(self.policy, [self._link(src, dst, layers, tokens)])[0][0]

    def reprefills(self, route: Route, tokens: int) -> bool:
        """Whether the decode side re-prefills the context instead of being handed its KV, as the runtime's
        coordinator decides it (`choose_handoff`, from the decode hops' measured prefill rates: a node that has
        never prefilled has none)."""
        prefill, decode = route.phases
        if prefill.last_token is not None or prefill.kv_links:
            return False
        seconds = reprefill_seconds(tokens, [self.by_name[h.peer].prefill_rate.value for h in decode.hops])
        if seconds is None:
            return False
        links = [self._link(self.by_name[h.peer], self.by_name[t.peer], t.last_layer - t.first_layer, tokens)
                 for h in prefill.hops for t in kv_targets(route, 0, h)]
        return choose_handoff(self.policy, links, seconds)[1]

    def _link(self, src: SimNode, dst: SimNode, layers: int, tokens: int) -> HandoffLink:
        rates = self.rates
        link = self.sim.network.link(src.index, dst.index)
        return HandoffLink(sizes={n: self.size(n, layers, tokens) for n in {*rates, "fp16"}},
                           pack={n: r[0] for n, r in rates.items()}, unpack={n: r[1] for n, r in rates.items()},
                           link=LinkEstimate(bandwidth=min(link.bytes_per_s, _UNLIMITED_BPS), latency=link.latency_s))

    def plan(self, handoff: RouteHandoff, tokens: int) -> dict[int, Plan]:
        """Per prefill hop: the codec and transfer mode of each of its links, for a context of `tokens` tokens
        (the same inputs give the same choice: memoized per route and length)."""
        key = (handoff, tokens)
        found = self._plans.get(key)
        if found is not None:
            return found
        found = {}
        for src, (layers, targets) in handoff.sources.items():
            outs = []
            for dst, lo, hi, named in targets:
                a, b = self.nodes[src], self.nodes[dst]
                codec = named or self.codec(a, b, hi - lo, tokens)
                link = self.sim.network.link(src, dst)
                mode = self.mode(KVTransfer(a.name, b.name, codec, hi - lo, tokens, self.size("fp16", hi - lo, tokens),
                                            self.size(codec, hi - lo, tokens), link.bytes_per_s, link.latency_s))
                if mode not in TRANSFER_MODES:
                    raise ValueError(f"the kv transfer choice gave {mode!r}, not one of {', '.join(TRANSFER_MODES)}")
                outs.append((dst, lo, hi, codec, mode))
            found[src] = (layers, tuple(outs))
        self._plans[key] = found
        return found

    # -- install: the decode hops reserve before the prefill starts --------------------------------------------

    def install(self, r: Any, now: float) -> None:
        """The coordinator installs a phase-split session: its codecs are chosen, its decode hops reserve."""
        h = r.handoff
        r.kv_out = self.plan(h, r.prefill_end)
        r.ready = len(h.receivers)
        r.prefilled_at = r.decode_at = -1.0
        coordinator = self.sim.network.coordinator
        heap, seq = self.sim.events.heap, self.sim.events.seq
        for index in h.receivers:
            at = now + self.sim.delay(coordinator, index)
            heapq.heappush(heap, (at, next(seq), self.INSTALL, index, (r, r.session)))

    def _install(self, now: float, index: int, payload: tuple[Any, int]) -> None:
        r, session = payload
        if r.session != session or r.done >= 0 or r.rejected:
            return  # the session failed or ended before its Install got here
        node = self.nodes[index]
        back = now + self.sim.delay(index, self.sim.network.coordinator)
        heap, seq = self.sim.events.heap, self.sim.events.seq
        self.installs += 1
        tokens = r.handoff_end  # the next phase's start: what the hop reserves before the prefill starts
        queue = self.waiting.setdefault(index, ReservationQueue()) if r.pull else None
        if queue is not None and not queue.request(node.ledger, (r, session), session, tokens):
            return  # booked at the hand-off: it waits for room, behind any that wait already
        if not r.pull and not node.ledger.reserve(session, tokens):
            self.full += 1
            why = f"no KV memory free on {node.name} for the {tokens} tokens handed over"
            heapq.heappush(heap, (back, next(seq), self.FULL, None, (r, session, why)))
            return
        node.kv_note(now)
        node.kv_coming[session] = r.handoff.receivers[index] * tokens  # layer-tokens still to come
        if index == r.first:
            node.kv_first.add(session)
        heapq.heappush(heap, (back, next(seq), self.READY, None, (r, session)))

    # -- booked at the hand-off: the KV waits on the prefill hops --------------------------------------------

    def queue(self, r: Any, now: float) -> None:
        """A session whose decode KV is booked at the hand-off starts: its codecs are chosen, and its decode hops
        hold its items until its KV comes (they reserve nothing yet)."""
        h = r.handoff
        r.kv_out = self.plan(h, r.prefill_end)
        r.prefilled_at = r.decode_at = -1.0
        r.pull = True
        tokens = r.handoff_end
        for index, layers in h.receivers.items():
            node = self.nodes[index]
            node.kv_coming[r.session] = layers * tokens
            if index == r.first:
                node.kv_first.add(r.session)

    def pull(self, r: Any, now: float) -> None:
        """The scheduler booked the session's decode KV: Install reaches each decode hop, which reserves."""
        self.pulls += 1
        r.ready = len(r.handoff.receivers)
        heap, seq = self.sim.events.heap, self.sim.events.seq
        coordinator = self.sim.network.coordinator
        for index in r.handoff.receivers:
            heapq.heappush(heap, (now + self.sim.delay(coordinator, index), next(seq), self.INSTALL, index,
                                  (r, r.session)))

    def freed(self, index: int, now: float) -> None:
        """KV was released at a decode hop: the sessions waiting there reserve, in order, while they fit."""
        queue = self.waiting.get(index)
        if queue is None:
            return
        back = now + self.sim.delay(index, self.sim.network.coordinator)

        def gone(key: tuple[Any, int]) -> bool:
            r, session = key
            return bool(r.session != session or r.done >= 0 or r.rejected)  # ended or moved while it waited

        for r, session in queue.grant(self.nodes[index].ledger, gone):
            self.nodes[index].kv_note(now)
            heapq.heappush(self.sim.events.heap, (back, next(self.sim.events.seq), self.READY, None, (r, session)))

    def push(self, r: Any, now: float) -> None:
        """Every decode hop reserved: the coordinator tells each prefill hop to send the KV it kept."""
        heap, seq = self.sim.events.heap, self.sim.events.seq
        coordinator = self.sim.network.coordinator
        for index in r.handoff.sources:
            heapq.heappush(heap, (now + self.sim.delay(coordinator, index), next(seq), self.PUSH, index,
                                  (r, r.session)))

    def _push(self, now: float, index: int, payload: tuple[Any, int]) -> None:
        r, session = payload
        if r.session != session or r.done >= 0 or r.rejected:
            return
        node = self.nodes[index]
        layers, targets = r.kv_out[index]
        kv = StepKV()
        groups: dict[int, list[Any]] = {}
        self._collect(groups, kv, session, r.handoff_end, tuple((t[0], t[1], t[2], t[3], LAYERWISE) for t in targets))
        kv.finals.append((session, r))
        self._layers(node, kv, groups, layers, now, 0.0, now)
        self.send(node, kv, now)

    def _ready(self, now: float, _: None, payload: tuple[Any, int]) -> None:
        assert self.sim.coordinator is not None
        self.sim.coordinator.on_ready(*payload, now)

    def _full(self, now: float, _: None, payload: tuple[Any, int, str]) -> None:
        assert self.sim.coordinator is not None
        self.sim.coordinator.on_full(*payload, now)

    # -- the prefill side: after each step ------------------------------------------------------------------------

    def step_done(self, node: SimNode, batch: list[Any], dur: float, now: float) -> StepKV | None:
        """A step of a node that hands KV on ended, before its results go on: what the step hands over. The
        layer-wise messages that left during the step go on their links now (a link is FIFO: they are ahead
        of the step's results); `send` does the rest once the results have gone."""
        index = node.index
        groups: dict[int, list[Any]] = {}  # target -> [lo, hi, wire, pack, unpack (each per layer), entries]
        kv = StepKV()
        layers = 0
        for it in batch:
            r = it.origin
            out = r.kv_out
            if out is None or it.session != r.session:
                continue
            mine = out.get(index)
            if mine is None:
                continue
            end = it.start + it.num_tokens
            stop = r.handoff_end  # the phase's end: the context's, or Cronus's k
            count = (end if end < stop else stop) - it.start
            if count <= 0:
                continue
            layers, targets = mine
            if r.pull:
                continue  # booked at the hand-off: the KV stays here until the decode hops have reserved
            if end >= stop:
                kv.finals.append((it.session, r))  # its last KV here: freed once it has left
            self._collect(groups, kv, it.session, count, targets)
        if groups:
            self._layers(node, kv, groups, layers, now - dur, dur, now)
        if not (kv.finals or kv.whole or kv.late or kv.entries):
            return None
        return kv

    def _collect(self, groups: dict[int, list[Any]], kv: StepKV, session: int, count: int,
                 targets: tuple[tuple[int, int, int, str, str], ...]) -> None:
        """One session's `count` tokens of KV at a prefill hop, to each target: a whole transfer, or its share of
        the target's layer-wise messages (`groups`: target -> [lo, hi, wire, pack, unpack per layer, entries])."""
        rates = self.rates
        fp16 = self.size("fp16", 1, count)
        for dst, lo, hi, codec, mode in targets:
            pack, unpack = rates.get(codec, (math.inf, math.inf))
            if mode == WHOLE:
                kv.whole.append((session, dst, hi - lo, count, codec, fp16 * (hi - lo)))
                continue
            group = groups.get(dst)
            if group is None:
                group = groups[dst] = [lo, hi, 0, 0.0, 0.0, []]
            wire = self.size(codec, 1, count)
            group[2] += wire
            group[3] += fp16 / pack
            group[4] += fp16 / unpack
            group[5].append((session, (hi - lo) * count))
            self._count(codec, wire * (hi - lo), fp16 * (hi - lo))

    def _layers(self, node: SimNode, kv: StepKV, groups: dict[int, list[Any]], layers: int, t0: float, dur: float,
                now: float) -> None:
        """Layer i of L is done at t0 + (i + 1) / L x dur; the packer takes the layers in order, each as it is
        done, and each packed layer leaves for every target that holds it."""
        free = node.pack_free
        for j in range(layers):
            done = t0 + (j + 1) * dur / layers
            for dst, (lo, hi, wire, pack, unpack, entries) in groups.items():
                if lo <= j < hi:
                    free = (free if free > done else done) + pack
                    chunk = (free, dst, wire, len(entries), unpack)
                    if free <= now:
                        self._chunk(node, kv, chunk)
                    else:
                        kv.late.append(chunk)
        node.pack_free = free
        for dst, group in groups.items():
            kv.entries[dst] = group[5]
            kv.chunks.setdefault(dst, [])

    def _chunk(self, node: SimNode, kv: StepKV, chunk: tuple[float, int, int, int, float]) -> None:
        depart, dst, wire, n, unpack = chunk
        net = self.sim.network
        link = net.table[node.index][dst] or net.link(node.index, dst)
        kv.chunks.setdefault(dst, []).append((link.send(depart, 1, n, 0, net.window, wire), unpack))
        self.messages += 1

    def send(self, node: SimNode, kv: StepKV, now: float) -> bool:
        """After the step's results went on: the layer-wise messages still to leave, then the whole transfers
        (the node packs them all, its next step waiting, then sends each, as the runtime's hop does). True when
        the node is held for the packing."""
        for chunk in kv.late:
            self._chunk(node, kv, chunk)
        for dst, entries in kv.entries.items():
            self._arrive(dst, entries, kv.chunks[dst], now)
        rates = self.rates
        hold = 0.0
        for _, _, _, _, codec, fp16 in kv.whole:
            hold += fp16 / rates.get(codec, (math.inf, math.inf))[0]
        depart = now + hold
        net = self.sim.network
        for session, dst, layers, count, codec, fp16 in kv.whole:
            wire = self.size(codec, layers, count)
            link = net.table[node.index][dst] or net.link(node.index, dst)
            arrival = link.send(depart, 1, 1, 0, net.window, wire)
            self.messages += 1
            self._count(codec, wire, fp16)
            self._arrive(dst, [(session, layers * count)], [(arrival, fp16 / rates.get(codec, (0, math.inf))[1])], now)
        if kv.finals:
            # Everything this hop computed for these sessions has left: their KV is not needed here, and the hop
            # tells the coordinator (HandedOver).
            at = max(depart, node.pack_free)
            self._release_at(node, [session for session, _ in kv.finals], at)
            back = at + self.sim.delay(node.index, self.sim.network.coordinator)
            for final in kv.finals:
                heapq.heappush(self.sim.events.heap, (back, next(self.sim.events.seq), self.HANDED, node.index, final))
        if hold <= 0:
            return False
        node.occupy(now, hold)
        node.batch = []  # not idle: nothing starts until the packing is done
        heapq.heappush(self.sim.events.heap, (depart, next(self.sim.events.seq), self.UNBLOCK, node.index, None))
        return True

    def _unblock(self, now: float, index: int, _: None) -> None:
        node = self.nodes[index]
        node.batch = None
        if node.queue:
            self.sim._step(node, now)

    def _handed(self, now: float, _: int, payload: tuple[int, Any]) -> None:
        assert self.sim.coordinator is not None
        session, r = payload
        self.sim.coordinator.on_handed(r, session, now)

    def _count(self, codec: str, wire: float, fp16: float) -> None:
        self.wire_bytes[codec] = self.wire_bytes.get(codec, 0.0) + wire
        self.fp16_bytes[codec] = self.fp16_bytes.get(codec, 0.0) + fp16
        self.transfers[codec] = self.transfers.get(codec, 0) + 1

    def _release_at(self, node: SimNode, sessions: list[int], at: float) -> None:
        for session in sessions:
            heapq.heappush(self.sim.events.heap, (at, next(self.sim.events.seq), RELEASE, node.index, session))

    # -- the decode side ------------------------------------------------------------------------------------------

    def _arrive(self, dst: int, entries: list[tuple[int, int]], chunks: list[tuple[float, float]], now: float) -> None:
        last = max(arrival for arrival, _ in chunks)
        heapq.heappush(self.sim.events.heap, (last if last > now else now, next(self.sim.events.seq), self.KV_IN, dst,
                                              (entries, chunks)))

    def _kv_in(self, now: float, index: int, payload: tuple[list[tuple[int, int]], list[tuple[float, float]]]) -> None:
        """A transfer's last byte is in: its messages are unpacked one after the other, each from its arrival."""
        entries, chunks = payload
        node = self.nodes[index]
        u = node.unpack_free
        for arrival, unpack in chunks:
            u = (u if u > arrival else arrival) + unpack
        node.unpack_free = u
        if u > now:
            heapq.heappush(self.sim.events.heap, (u, next(self.sim.events.seq), self.KV_DONE, index, entries))
        else:
            self._kv_done(now, index, entries)

    def _kv_done(self, now: float, index: int, entries: list[tuple[int, int]]) -> None:
        """KV unpacked into the hop's cache: a session that has every layer's whole context may run."""
        node = self.nodes[index]
        wait = node.kv_coming
        ready: list[Any] = []
        for session, n in entries:
            left = wait.get(session)
            if left is None:
                continue  # released meanwhile
            if left > n:
                wait[session] = left - n
                continue
            del wait[session]
            held = node.kv_held.pop(session, None)
            if held:
                ready += held
        if ready:
            node.queue.extend(ready)
            if node.batch is None:
                self.sim._step(node, now)

    def hold(self, node: SimNode, items: list[Any]) -> list[Any]:
        """Items that reached a hop still waiting for handed-over KV wait with their session; the rest go on."""
        wait = node.kv_coming
        free = []
        for it in items:
            if it.session in wait:
                node.kv_held.setdefault(it.session, []).append(it)
            else:
                free.append(it)
        return free

    def started(self, node: SimNode, batch: list[Any], now: float) -> None:
        """A step of a decode phase's first hop began: note the sessions whose first decode step this is."""
        first = node.kv_first
        for it in batch:
            if it.session in first and not it.pf:
                first.discard(it.session)
                it.origin.decode_at = now

    def summary(self) -> dict[str, Any]:
        return {"installs": self.installs, "refused_full": self.full, "messages": self.messages,
                "handoffs_booked": self.pulls, "reservations_waited": sum(q.waited for q in self.waiting.values()),
                "bytes_by_codec": dict(sorted(self.wire_bytes.items())),
                "fp16_bytes_by_codec": dict(sorted(self.fp16_bytes.items())),
                "transfers_by_codec": dict(sorted(self.transfers.items())),
                # The rates the codecs were priced and timed with (measured ones differ from run to run).
                "codec_rates": {c: list(r) for c, r in sorted((self._rates or {}).items())}}
