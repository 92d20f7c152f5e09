"""Cronus and its four baselines (Cronus §5) on a pair of a high-end and a low-end GPU, simulated iteration by
iteration with the runtime's policy objects.

- "cronus": the low-end GPU is the partial prefill instance (PPI: one prompt at a time, the first L_p tokens),
  the high-end one the chunked prefill instance (CPI: the rest of each prompt as chunked prefill, 512 tokens an
  iteration, beside its decodes, then the decodes). The frontend admits requests to the PPI, at most two
  there at a time, and `CronusBalancer` picks L_p from Eq. 2 and 3 fitted on the two devices
  (`planner.cronus_fit`) and the CPI's state at dispatch; both run inside the coordinator's own
  `CronusScheduler`, which the simulator drives as the coordinator does. The PPI's KV of [0, L_p) crosses the
  link (fp16, the paper's vLLM) before the CPI continues the prompt.
- "disagg-hl" / "disagg-lh": the same code with `WholePrompt` (L_p = L_in, §5.1): the high-end (HL) or
  low-end (LH) GPU prefills whole prompts one at a time, the other decodes. As in the paper, their TTFT includes
  the KV transfer (the first token counts when the KV has reached the decode GPU).
- "dp": each GPU a whole-model instance with chunked prefill (512 tokens an iteration on the high-end GPU, 256
  on the low-end one), fed by `WeightedRoundRobin` (weights 3 and 1, waiting queues of at most 3 and 1).
- "pp": one pipeline, layers split by FP16 FLOP/s (23+9 for LLaMA-3 8B on A100+A10, as the paper), chunked
  prefill of 512 tokens, as vLLM 0.6 runs pipeline parallelism: two virtual engines (one per stage), each with
  its own scheduler and half the KV blocks (the smaller stage pool decides), each sending its next micro-batch
  when its last one has come back; new requests go to the engine with the fewest unfinished ones. Activations
  cross the link between the stages.

What it leaves out: the frontend and the engines' CPU time (vLLM's scheduling, sampling, detokenizing), the
embedding and output layers' compute, and the KV transfer's overlap with the CPI's first iteration (it is
charged before the CPI queues the rest of the prompt). docs/cronus.md compares the results with the paper's.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

from hetnode.coordinator.cronus_scheduler import CronusScheduler
from hetnode.coordinator.scheduler import Decision
from hetnode.planner.costmodel import DEFAULT_ROOFLINE, Roofline
from hetnode.planner.cronus_fit import fit_chunked_iteration, fit_partial_prefill
from hetnode.planner.devices import DeviceSpec
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.policy.cronus import CpiState, CronusBalancer, Splitter, WholePrompt
from hetnode.policy.weighted_rr import WeightedRoundRobin
from hetnode.testnet.sim.pair_engine import BLOCK_SIZE, Engine, PairRequest, Work, iteration_seconds, kv_tokens

DESIGNS = ("cronus", "dp", "pp", "disagg-hl", "disagg-lh")
CHUNK = 512  # §5.1: the token budget of every chunked-prefill iteration
LOW_DP_CHUNK = 256  # §5.1: DP's low-end instance
WHOLE = 1 << 20  # a PPI's budget: a prompt's part in one pass
DP_WEIGHTS = (3, 1)  # §5.1: high-end, low-end
DP_QUEUES = (3, 1)


@dataclass(frozen=True)
class PairSetup:
    """A high-end and a low-end GPU on two hosts joined by one link (§5.1: InfiniBand, 100 Gb/s)."""

    high: DeviceSpec
    low: DeviceSpec
    model: ModelSpec
    link_gbps: float = 100.0
    link_latency_s: float = 10e-6
    # How a step's roofline becomes seconds, for every engine and for Cronus's profile fits alike.
    roofline: Roofline = DEFAULT_ROOFLINE

    def __post_init__(self) -> None:
        if not self.link_gbps > 0 or not self.link_latency_s >= 0:
            raise ValueError(f"the link needs a positive bandwidth and a latency >= 0: {self}")


@dataclass
class PairResult:
    design: str
    requests: list[PairRequest]
    busy_s: dict[str, float]
    makespan_s: float
    splits: list[int] = field(default_factory=list)
    decisions: int = 0
    iterations: dict[str, int] = field(default_factory=dict)  # per engine (PP: per virtual engine)
    preemptions: int = 0

    def finished(self) -> list[PairRequest]:
        return [r for r in self.requests if r.finish >= 0]

    @property
    def throughput(self) -> float:
        """Requests finished per second from the first arrival to the last finish."""
        done = self.finished()
        start = min((r.arrival for r in self.requests), default=0.0)
        end = max((r.finish for r in done), default=start)
        return len(done) / (end - start) if end > start else 0.0

    def ttft(self, q: float) -> float:
        return _quantile([r.first_token - r.arrival for r in self.finished()], q)

    def tbt(self, q: float) -> float:
        return _quantile([g for r in self.finished() for g in r.gaps], q)

    def utilization(self) -> dict[str, float]:
        return {k: v / self.makespan_s if self.makespan_s > 0 else 0.0 for k, v in self.busy_s.items()}


def _quantile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return math.nan
    ys = sorted(xs)
    return ys[min(len(ys) - 1, max(0, math.ceil(q * len(ys)) - 1))]


class Loop:
    """The event heap: (time, seq, callback, argument); seq keeps same-time events in the order scheduled."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Callable[[Any, float], None], Any]] = []
        self.seq = count()
        self.now = 0.0

    def at(self, time: float, fn: Callable[[Any, float], None], arg: Any = None) -> None:
        heapq.heappush(self.heap, (time, next(self.seq), fn, arg))

    def run(self) -> float:
        while self.heap:
            self.now, _, fn, arg = heapq.heappop(self.heap)
            fn(arg, self.now)
        return self.now


class Link:
    """One direction of the link: alpha-beta with a FIFO queue."""

    def __init__(self, setup: PairSetup) -> None:
        self.bytes_per_s = setup.link_gbps * 1e9 / 8
        self.latency = setup.link_latency_s
        self.free = 0.0

    def send(self, now: float, nbytes: float) -> float:
        """When `nbytes` sent at `now` have arrived."""
        self.free = max(self.free, now) + nbytes / self.bytes_per_s
        return self.free + self.latency


class Design:
    """Engines that run iterations on the loop; subclasses say where requests go and what an iteration did."""

    name = ""

    def __init__(self, setup: PairSetup, loop: Loop) -> None:
        self.setup = setup
        self.model = setup.model
        self.loop = loop
        self.engines: list[Engine] = []
        self.splits: list[int] = []
        self.decisions = 0

    def arrive(self, r: PairRequest, now: float) -> None:
        raise NotImplementedError

    def done(self, engine: Engine, batch: list[Work], now: float) -> None:
        raise NotImplementedError

    def kick(self, engine: Engine, now: float) -> None:
        """Start the engine's next iteration if it is idle and has work that can run."""
        if engine.busy:
            return
        formed = engine.form()
        if formed is None:
            return
        _, seconds = formed
        engine.busy = True
        engine.busy_s += seconds
        self.loop.at(now + seconds, self._ended, engine)

    def _ended(self, engine: Engine, now: float) -> None:
        batch, engine.running = engine.running, []
        engine.busy = False
        self.done(engine, batch, now)
        self.kick(engine, now)

    def advance(self, engine: Engine, w: Work, now: float) -> None:
        """The usual end of an item's iteration on an engine that samples: a prompt's last chunk or a decode gives
        a token; the request goes on decoding here, or ends and frees its KV."""
        end = w.start + w.num_tokens
        if end < w.prefill_end:
            return  # a piece of a chunked prompt: its rest is still queued
        if w.request.token(now):
            engine.release(w.session)
            return
        engine.add(Work(w.request, end, 1, end))

    def kv_bytes(self, tokens: int, layers: int | None = None) -> float:
        return tokens * self.model.kv_bytes_per_token_layer * (self.model.num_layers if layers is None else layers)


class PartialPrefill(Design):
    """Cronus's pair (and the disaggregated baselines through the same code): a PPI and a CPI, routed by the
    coordinator's own `CronusScheduler` with the CPI engine's exact state."""

    def __init__(self, setup: PairSetup, loop: Loop, *, ppi: DeviceSpec, cpi: DeviceSpec, splitter: Splitter,
                 name: str, queue_limit: int, refit_window: int = 0) -> None:
        super().__init__(setup, loop)
        self.name = name
        m = setup.model
        self.ppi = Engine("ppi", ppi, m, m.num_layers, kv_tokens=kv_tokens(ppi, m, m.num_layers),
                          max_batch_tokens=WHOLE, max_prompts=1, roofline=setup.roofline)
        self.cpi = Engine("cpi", cpi, m, m.num_layers, kv_tokens=kv_tokens(cpi, m, m.num_layers),
                          max_batch_tokens=CHUNK, roofline=setup.roofline)
        self.engines = [self.ppi, self.cpi]
        # The frontend holds requests for the PPI only (§4.2): no KV mask (Algorithm 1 itself gives the PPI the
        # whole prompt when the CPI lacks room), and a queue as long as the workload.
        self.scheduler = CronusScheduler(pair_plan(m), splitters=[splitter], cpi_state=lambda _: self.cpi_state(),
                                         queue_limit=queue_limit, max_batch_tokens=CHUNK, refit_window=refit_window)
        self.link = Link(setup)
        self.requests: dict[str, PairRequest] = {}

    def cpi_state(self) -> CpiState:
        decodes, context = self.cpi.state_decodes
        return CpiState(decodes=decodes, decode_context=context, free_blocks=max(0, self.cpi.ledger.free),
                        block_size=BLOCK_SIZE, max_batch_tokens=CHUNK)

    def arrive(self, r: PairRequest, now: float) -> None:
        self.requests[r.rid] = r
        self._decided([self.scheduler.submit(r.rid, r.prompt, now)], now)

    def _decided(self, decisions: Sequence[Decision], now: float) -> None:
        for d in decisions:
            if d.queued:
                continue
            if d.pipeline is None or d.decode is None:
                raise RuntimeError(f"the Cronus scheduler gave {d.request_id} no PPI-CPI route: {d.reason}")
            r = self.requests[d.request_id]
            r.split = r.prompt if d.split is None else d.split
            self.splits.append(r.split)
            self.ppi.add(Work(r, 0, r.split, r.split))
        self.decisions = self.scheduler.decisions
        self.kick(self.ppi, now)

    def done(self, engine: Engine, batch: list[Work], now: float) -> None:
        if engine is self.cpi:
            for w in batch:
                self._serve(w, now)
            return
        for w in batch:  # the PPI: one partial prefill, whole
            r = w.request
            arrival = self.link.send(now, self.kv_bytes(r.split))
            self.loop.at(arrival, self._handed, r)
            self._decided(self.scheduler.partial_done(r.rid, now), now)

    def _serve(self, w: Work, now: float) -> None:
        r = w.request
        before = r.generated
        self.advance(self.cpi, w, now)
        self._told(r, before, now)

    def _told(self, r: PairRequest, before: int, now: float) -> None:
        """The scheduler hears of a request's first token and of its end, as the coordinator tells it."""
        if before == 0 and r.generated:
            self._decided(self.scheduler.prefilled(r.rid, now), now)
        if r.finish >= 0 and r.generated > before:
            self._decided(self.scheduler.finish(r.rid, r.generated, now), now)

    def _handed(self, r: PairRequest, now: float) -> None:
        """The KV of [0, L_p) is at the CPI: the PPI's copy goes, the CPI goes on with the prompt or decodes."""
        self.ppi.release(r.rid)
        if r.split >= r.prompt:  # prefilled whole: the PPI sampled the first token, which counts now (§5.1)
            done = r.token(now)
            self._told(r, 0, now)
            if not done:
                self.cpi.add(Work(r, r.prompt, 1, r.prompt))
        else:
            self.cpi.add(Work(r, r.split, r.prompt - r.split, r.prompt))
        self.kick(self.cpi, now)
        self.kick(self.ppi, now)


def pair_plan(model: ModelSpec) -> PlacementPlan:
    """The plan of one pair: node "ppi" and node "cpi", each holding the whole model."""
    return PlacementPlan(cluster="pair", model=model.name, num_layers=model.num_layers, method="cronus",
                         placements=(NodePlacement("ppi", 0, model.num_layers),
                                     NodePlacement("cpi", 0, model.num_layers)),
                         partial_inference=False, replicas=(Replica("ppi", ("ppi",)), Replica("cpi", ("cpi",))))


class DataParallel(Design):
    name = "dp"

    def __init__(self, setup: PairSetup, loop: Loop) -> None:
        super().__init__(setup, loop)
        m = setup.model
        self.high = Engine("high", setup.high, m, m.num_layers, kv_tokens=kv_tokens(setup.high, m, m.num_layers),
                           max_batch_tokens=CHUNK, roofline=setup.roofline)
        self.low = Engine("low", setup.low, m, m.num_layers, kv_tokens=kv_tokens(setup.low, m, m.num_layers),
                          max_batch_tokens=LOW_DP_CHUNK, roofline=setup.roofline)
        self.engines = [self.high, self.low]
        self.by_name = {"high": self.high, "low": self.low}
        self.rr = WeightedRoundRobin(dict(zip(self.by_name, DP_WEIGHTS, strict=True)),
                                     dict(zip(self.by_name, DP_QUEUES, strict=True)))
        self.requests: dict[str, PairRequest] = {}

    def arrive(self, r: PairRequest, now: float) -> None:
        self.requests[r.rid] = r
        self._send(self.rr.submit(r.rid, self._waiting()), now)

    def _waiting(self) -> dict[str, int]:
        return {name: e.waiting() for name, e in self.by_name.items()}

    def _send(self, picks: list[tuple[str, str]], now: float) -> None:
        for rid, name in picks:
            r = self.requests[rid]
            engine = self.by_name[name]
            engine.add(Work(r, 0, r.prompt, r.prompt))
            self.kick(engine, now)
        self.decisions = self.rr.decisions

    def done(self, engine: Engine, batch: list[Work], now: float) -> None:
        for w in batch:
            self.advance(engine, w, now)
        self._send(self.rr.dispatch(self._waiting()), now)


def pp_layers(setup: PairSetup) -> tuple[int, int]:
    """Layers on the high-end and the low-end GPU, in proportion to their FP16 FLOP/s (§5.1)."""
    n = setup.model.num_layers
    high = round(n * setup.high.fp16_tflops / (setup.high.fp16_tflops + setup.low.fp16_tflops))
    return min(n - 1, max(1, high)), n - min(n - 1, max(1, high))


class PipelineParallel(Design):
    name = "pp"

    def __init__(self, setup: PairSetup, loop: Loop) -> None:
        super().__init__(setup, loop)
        m = setup.model
        self.layers = pp_layers(setup)
        self.devices = (setup.high, setup.low)
        # vLLM: the smaller stage's pool sets the block count, and each virtual engine gets its share of it.
        pool = min(kv_tokens(d, m, n, embeddings=False) - _embedding_tokens(d, m, n)
                   for d, n in zip(self.devices, self.layers, strict=True))
        # (The virtual engines only form micro-batches: each stage prices them below, on its own device.)
        self.engines = [Engine(f"ve{i}", setup.high, m, m.num_layers, kv_tokens=pool // 2, max_batch_tokens=CHUNK,
                               roofline=setup.roofline) for i in range(2)]
        self.stage_free = [0.0, 0.0]
        self.stage_busy = [0.0, 0.0]
        self.link = Link(setup)
        self.back = Link(setup)
        self.unfinished = [0, 0]
        self.owner: dict[str, int] = {}

    def arrive(self, r: PairRequest, now: float) -> None:
        v = min(range(2), key=lambda i: self.unfinished[i])
        self.unfinished[v] += 1
        self.owner[r.rid] = v
        self.engines[v].add(Work(r, 0, r.prompt, r.prompt))
        self.kick(self.engines[v], now)

    def kick(self, engine: Engine, now: float) -> None:
        """A virtual engine sends its next micro-batch through both stages; it is busy until that comes back."""
        if engine.busy:
            return
        formed = engine.form()
        if formed is None:
            return
        batch, _ = formed
        engine.busy = True
        t = now
        tokens = sum(w.num_tokens for w in batch)
        for s in range(2):
            seconds = iteration_seconds(self.devices[s], self.model.shape, self.layers[s], batch,
                                        self.setup.roofline)
            t = max(t, self.stage_free[s]) + seconds
            self.stage_free[s] = t
            self.stage_busy[s] += seconds
            if s == 0:  # the hidden states of the micro-batch go to the next stage
                t = self.link.send(t, tokens * self.model.activation_bytes)
        self.loop.at(self.back.send(t, 4 * len(batch)), self._ended, engine)

    def done(self, engine: Engine, batch: list[Work], now: float) -> None:
        for w in batch:
            self.advance(engine, w, now)
            if w.request.finish >= 0:
                self.unfinished[self.owner.pop(w.session)] -= 1


def _embedding_tokens(device: DeviceSpec, model: ModelSpec, layers: int) -> int:
    """KV tokens one of the embedding or output matrices costs a stage holding `layers` layers."""
    return int(model.vocab_size * model.hidden_size * model.bytes_per_param
               // (model.kv_bytes_per_token_layer * layers))


def build(design: str, setup: PairSetup, loop: Loop, *, queue_limit: int = 1 << 20, refit_window: int = 0) -> Design:
    """A design of the pair; `refit_window` (Cronus: 0, the reproduction's setting, keeps the profile fits) lets
    its balancer refit Eqs. 2 and 3 on the times it sees, as the coordinator's does."""
    if design == "cronus":
        balancer = CronusBalancer(fit_partial_prefill(setup.low, setup.model, setup.roofline),
                                  fit_chunked_iteration(setup.high, setup.model, CHUNK, setup.roofline))
        return PartialPrefill(setup, loop, ppi=setup.low, cpi=setup.high, splitter=balancer, name=design,
                              queue_limit=queue_limit, refit_window=refit_window)
    if design in ("disagg-hl", "disagg-lh"):
        ppi, cpi = (setup.high, setup.low) if design == "disagg-hl" else (setup.low, setup.high)
        return PartialPrefill(setup, loop, ppi=ppi, cpi=cpi, splitter=WholePrompt(), name=design,
                              queue_limit=queue_limit)
    if design == "dp":
        return DataParallel(setup, loop)
    if design == "pp":
        return PipelineParallel(setup, loop)
    raise ValueError(f"unknown design {design!r}; known: {', '.join(DESIGNS)}")


def simulate_pair(design: str, setup: PairSetup, prompts: Sequence[int], outputs: Sequence[int],
                  arrivals: Sequence[float]) -> PairResult:
    """Serve the requests (prompt and output lengths, arrival times) with `design` until every one is done."""
    if not len(prompts) == len(outputs) == len(arrivals) or not prompts:
        raise ValueError("need as many prompts, outputs and arrivals, and at least one request")
    if any(p < 1 for p in prompts) or any(o < 1 for o in outputs):
        raise ValueError("every request needs a prompt and an output of at least one token")
    loop = Loop()
    d = build(design, setup, loop, queue_limit=len(prompts))
    requests = [PairRequest(f"r{i}", a, p, o) for i, (p, o, a) in enumerate(zip(prompts, outputs, arrivals,
                                                                                strict=True))]
    for r in requests:
        loop.at(r.arrival, d.arrive, r)
    end = loop.run()
    unfinished = [r.rid for r in requests if r.finish < 0]
    if unfinished:
        raise RuntimeError(f"{design}: {len(unfinished)} requests never finished (first: {unfinished[0]})")
    if isinstance(d, PipelineParallel):
        busy = {f"stage{s}:{dev.name}": d.stage_busy[s] for s, dev in enumerate(d.devices)}
    else:
        busy = {f"{e.name}:{e.device.name}": e.busy_s for e in d.engines}
    return PairResult(design, requests, busy, end - min(arrivals), d.splits, d.decisions,
                      {e.name: e.iterations for e in d.engines}, sum(e.preemptions for e in d.engines))
