"""Instance-level simulation of EcoServe (PaDG) and its NoDG and FuDG baselines (EcoServe §4).

    result = simulate_instances(model, workload, PadgOptions(design="ecoserve", tp=4, instances=8),
                                duration_s=120, warmup_s=20, slos=Slos(5.0, 0.1))

Where `runner.py` simulates layer pipelines over nodes, EcoServe's unit is an instance: one whole model on `tp`
GPUs of one host (tensor parallel), priced per step by `planner/instance_cost.py`. Every decision is a policy
object the runtime runs too:

- each instance's steps: `policy.instance_steps.InstanceScheduler` ("separate": EcoServe's instance scheduler
  and vLLM; "hybrid": Sarathi's chunked prefill with decodes first);
- EcoServe's routing: `policy.ecoserve_overall.Overall` (macro-instances by capability) over
  `policy.macro_scheduler.MacroScheduler` (Algorithms 1 and 2 on the instances' reported states, with a
  `PrefillPredictor` fitted on the instance's profiled prefill times); instances report on a phase switch, a
  finish or a preemption, and every `status_every_s` while they decode, each report arriving
  `status_latency_s` later;
- the baselines' routing: join the least-loaded instance (`policy.balancer.least_loaded`);
- mitosis scaling: `Overall.add`/`remove` and `ScalingTrigger` once per `window_s`.

Designs (`DESIGNS`):

| design | instances | steps | routing | KV |
|---|---|---|---|---|
| ecoserve | all alike | separate | macro-instances | stays |
| vllm | all alike | separate (prefill first) | least loaded | stays |
| sarathi | all alike | hybrid (decode first, chunked) | least loaded | stays |
| distserve | prefill and decode instances on every host | separate | least loaded per role | over the host's PCIe |
| mooncake | one per host, `prefill` of them prefill | separate | least loaded per role | over the hosts' NICs |

A FuDG request's KV (its whole prompt's, after its prefill) crosses one link, FIFO behind the link's other
transfers (alpha-beta); its decode starts when it has arrived and the decode instance admits it.

Metrics per request (§3.3): TTFT (arrival to first token) and EcoServe's TTFT, to the start of the request's first
decode step (the phase-switch wait, and a FuDG design's KV transfer, included); TPOT is measured from the decode
start, over the output's remaining tokens. A request meets the SLOs when its EcoServe TTFT and its TPOT do.
"""

from __future__ import annotations

import contextlib
import functools
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from hetnode.errors import ConfigError
from hetnode.planner.costmodel import DEFAULT_ROOFLINE, Roofline
from hetnode.planner.devices import parse_device
from hetnode.planner.instance_cost import PCIE_GBPS, Chunk, InstanceCost
from hetnode.planner.model import ModelSpec
from hetnode.policy.balancer import least_loaded
from hetnode.policy.ecoserve import Slos
from hetnode.policy.ecoserve_overall import Overall, Scaler, ScalingTrigger, attainment
from hetnode.policy.instance_steps import HYBRID, SEPARATE, InstanceConfig, InstanceScheduler, Plan
from hetnode.policy.macro_scheduler import MacroScheduler
from hetnode.policy.prefill_predictor import PROFILE_LENGTHS, PrefillPredictor
from hetnode.testnet.sim.workload import Workload

DESIGNS = ("ecoserve", "vllm", "sarathi", "distserve", "mooncake")
FUDG = ("distserve", "mooncake")


@dataclass(frozen=True)
class PadgOptions:
    """One deployment of a design; defaults are EcoServe's L20 setup with LLaMA-30B (§4.1-4.2)."""

    design: str = "ecoserve"
    device: str = "l20"
    tp: int = 4  # GPUs per instance (Table 4's degrees: 4 for the 30B and 34B models, 8 for Qwen2-72B)
    instances: int = 8  # instances deployed (all of them; FuDG: prefill + decode)
    per_host: int = 1  # instances per host (EcoServe's L20 runs: one per 8-GPU node)
    prefill: int = 0  # FuDG: how many of the instances prefill (0: half, at least one)
    nic_gbps: float = 10.0  # hosts' Ethernet (EcoServe's L20 cluster: 10 Gb/s)
    nic_latency_s: float = 100e-6
    pcie_gbps: float = PCIE_GBPS  # GB/s between GPUs of a host (TP and DistServe's KV)
    token_budget: int = 512  # Sarathi's tokens per step
    max_batch_tokens: int = 8192  # prefill tokens per separate step
    max_decodes: int = 256
    reserve: int = 0  # tokens of growth kept per running request at admission
    n_lower: int = 4  # mitosis N_l (Fig. 10's setting)
    n_upper: int = 16  # mitosis N_u
    status_every_s: float = 0.1  # an instance reports its decode progress this often
    status_latency_s: float = 0.0005  # a report's trip to the macro-instance scheduler (ZeroMQ on one LAN)
    # Mitosis scaling (dynamic): start with `instances`, grow up to `max_instances` (0: never scale).
    max_instances: int = 0
    window_s: float = 30.0
    scale_target: float = 0.9
    scale_low_use: float = 0.3
    scale_idle_windows: int = 4
    drain_s: float = 300.0
    roofline: Roofline = DEFAULT_ROOFLINE  # how a step's roofline becomes seconds (costmodel.ROOFLINES)

    def __post_init__(self) -> None:
        if self.design not in DESIGNS:
            raise ConfigError(f"unknown design {self.design!r}; known: {', '.join(DESIGNS)}", key="--placement")
        if self.instances < 1 or self.per_host < 1 or self.tp < 1:
            raise ConfigError(f"need instances, per_host and tp >= 1: {self}")
        if self.design in FUDG and self.instances < 2:
            raise ConfigError(f"{self.design} needs a prefill and a decode instance at least")
        if not 0 <= self.prefill < self.instances:
            raise ConfigError(f"prefill instances must be in [0, {self.instances}), not {self.prefill}")
        if self.max_instances and self.max_instances < self.instances:
            raise ConfigError(f"max_instances ({self.max_instances}) < instances ({self.instances})")
        if not 1 <= self.n_lower < self.n_upper:
            raise ConfigError(f"need 1 <= N_l < N_u, not {self.n_lower} and {self.n_upper}")


@dataclass
class Request:
    rid: int
    arrival: float
    prompt: int
    output: int
    gen: int = 0
    first_token: float = math.nan
    decode_start: float = math.nan
    last_token: float = math.nan
    instance: int = -1

    @property
    def finished(self) -> bool:
        return self.gen >= self.output

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def ttft_eco(self) -> float:
        """EcoServe's TTFT (§3.3): to the start of the decode phase (the first token's when it has no decode)."""
        return (self.decode_start if self.output > 1 else self.first_token) - self.arrival

    @property
    def tpot(self) -> float:
        return (self.last_token - self.decode_start) / (self.output - 1) if self.output > 1 else 0.0

    def meets(self, slos: Slos) -> bool:
        return self.finished and slos.met(arrival=self.arrival, first_token=self.first_token,
                                          decode_start=self.decode_start, last_token=self.last_token,
                                          output=self.output)


@dataclass
class Instance:
    index: int
    host: int
    role: str  # "mixed", "prefill" or "decode"
    scheduler: InstanceScheduler
    active: bool = True
    busy_until: float = -1.0
    plan: Plan | None = None
    busy_s: float = 0.0  # in the measurement window
    busy_all: float = 0.0
    busy_mark: float = 0.0  # busy_all at the last scaling window
    # Step statistics (whole run): seconds, steps and items by kind ("prefill", "decode", "hybrid").
    kind_s: dict[str, float] = field(default_factory=dict)
    kind_steps: dict[str, int] = field(default_factory=dict)
    kind_items: dict[str, int] = field(default_factory=dict)
    last_report: float = -math.inf


class _Events:
    def __init__(self) -> None:
        self.heap: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = 0
        self.now = 0.0

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, fn))

    def run(self, until: float) -> None:
        while self.heap and self.heap[0][0] <= until:
            t, _, fn = heapq.heappop(self.heap)
            self.now = t
            fn(t)


class _Link:
    """A FIFO link (alpha-beta): a transfer starts when the link is free."""

    def __init__(self, gbps: float, latency_s: float) -> None:
        self.bytes_per_s, self.latency_s, self.free = gbps * 1e9, latency_s, 0.0

    def send(self, now: float, nbytes: float) -> float:
        start = max(now, self.free)
        self.free = start + nbytes / self.bytes_per_s
        return self.free + self.latency_s


@dataclass
class PadgResult:
    options: PadgOptions
    slos: Slos
    requests: list[Request]
    window: tuple[float, float]
    instance_busy: list[float]
    scaling: list[dict[str, Any]] = field(default_factory=list)
    steps: dict[str, dict[str, float]] = field(default_factory=dict)  # by kind: seconds, steps, mean items

    def measured(self) -> list[Request]:
        return [r for r in self.requests if self.window[0] <= r.arrival < self.window[1]]

    def attainment(self) -> float:
        reqs = self.measured()
        return sum(r.meets(self.slos) for r in reqs) / len(reqs) if reqs else math.nan

    def summary(self) -> dict[str, Any]:
        reqs = self.measured()
        done = [r for r in reqs if r.finished]
        span = self.window[1] - self.window[0]

        def pct(values: Sequence[float], q: float) -> float | None:
            vals = sorted(v for v in values if not math.isnan(v))
            return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else None

        return {
            "design": self.options.design, "requests": len(reqs), "finished": len(done),
            "slo_attainment": self.attainment(),
            "request_rate": len(reqs) / span, "throughput_tokens_s": sum(r.gen for r in reqs) / span,
            "ttft_p50": pct([r.ttft for r in done], 0.5), "ttft_p90": pct([r.ttft for r in done], 0.9),
            "ttft_eco_p50": pct([r.ttft_eco for r in done], 0.5), "ttft_eco_p90": pct([r.ttft_eco for r in done], 0.9),
            "tpot_p50": pct([r.tpot for r in done], 0.5), "tpot_p90": pct([r.tpot for r in done], 0.9),
            "utilization": sum(self.instance_busy) / (span * len(self.instance_busy)) if self.instance_busy else 0.0,
            "scaling_events": len(self.scaling), "steps": self.steps,
        }


def instance_cost(model: ModelSpec, options: PadgOptions) -> InstanceCost:
    return InstanceCost(parse_device(options.device), options.tp, model, link_gbps=options.pcie_gbps,
                        roofline=options.roofline)


def fit_predictor(cost: InstanceCost) -> PrefillPredictor:
    """Algorithm 2's predictor, fitted on the instance's profiled prefill times (as a node profiles itself)."""
    return PrefillPredictor.fit([(n, cost.prefill_s(n)) for n in PROFILE_LENGTHS])


class PadgSim:
    """One run; `simulate_instances` is the entry point."""

    def __init__(self, model: ModelSpec, options: PadgOptions, slos: Slos) -> None:
        self.o, self.slos = options, slos
        self.cost = instance_cost(model, options)
        if self.cost.kv_tokens < 1:
            raise ConfigError(f"{model.name} does not fit {options.tp} x {options.device}")
        self.events = _Events()
        self.requests: list[Request] = []
        self.window: tuple[float, float] = (0.0, math.inf)  # the measured arrivals' span
        total = max(options.instances, options.max_instances)
        prefills = options.prefill or max(1, options.instances // 2)
        config = InstanceConfig(discipline=HYBRID if options.design == "sarathi" else SEPARATE,
                                max_batch_tokens=options.max_batch_tokens, token_budget=options.token_budget,
                                max_decodes=options.max_decodes, kv_tokens=self.cost.kv_tokens,
                                reserve=options.reserve)
        self.instances = []
        for k in range(total):
            role = "mixed"
            if options.design == "distserve":  # a prefill and a decode instance side by side on each host
                role = "prefill" if k % 2 == 0 and k // 2 < prefills else "decode"
            elif options.design == "mooncake":
                role = "prefill" if k < prefills else "decode"
            self.instances.append(Instance(k, k // options.per_host, role, InstanceScheduler(config),
                                           active=k < options.instances))
        self.pcie = {i.host: _Link(options.pcie_gbps, 10e-6) for i in self.instances}
        self.up = {i.host: _Link(options.nic_gbps / 8, options.nic_latency_s) for i in self.instances}
        self.down = {i.host: _Link(options.nic_gbps / 8, 0.0) for i in self.instances}
        self.overall: Overall | None = None
        if options.design == "ecoserve":
            predictor = fit_predictor(self.cost)
            self.overall = Overall(options.n_lower, options.n_upper, lambda: MacroScheduler(slos, predictor))
            for inst in self.instances:
                if inst.active:
                    self.overall.add(inst.index, inst.scheduler.status())
        self.scaler = None if self.overall is None else Scaler(
            self.overall, ScalingTrigger(options.scale_target, options.scale_low_use, options.scale_idle_windows),
            [i.index for i in self.instances])
        self.scaling: list[dict[str, Any]] = []

    # -- arrivals and routing ------------------------------------------------------------------------------

    def arrive(self, r: Request, now: float) -> None:
        self.requests.append(r)
        if r.prompt + r.output > self.cost.kv_tokens:
            return  # never fits an instance: counted as a miss
        if self.overall is not None:
            k = cast(int, self.overall.route(r.prompt, r.prompt, now))
        else:
            role = "prefill" if self.o.design in FUDG else "mixed"
            pool = [i for i in self.instances if i.active and i.role == role]
            k = pool[least_loaded([i.scheduler.load for i in pool])].index
        r.instance = k
        inst = self.instances[k]
        inst.scheduler.route(r.rid, r.prompt, now)
        self.kick(inst, now)

    def kick(self, inst: Instance, now: float) -> None:
        if inst.busy_until > now or inst.plan is not None:
            return
        phase = inst.scheduler.phase
        plan = inst.scheduler.next_step(now)
        if inst.scheduler.phase != phase:
            self.report(inst, now)
        if plan is None:
            return
        for rid, _ in plan.decodes:
            r = self.requests[rid]
            if math.isnan(r.decode_start):
                r.decode_start = now
        chunks = [Chunk(take, done) for _, done, take in plan.chunks]
        seconds = self.cost.step_s(chunks, [ctx for _, ctx in plan.decodes])
        inst.plan, inst.busy_until = plan, now + seconds
        inst.busy_s += seconds if self.window[0] <= now < self.window[1] else 0.0
        inst.busy_all += seconds
        inst.kind_s[plan.kind] = inst.kind_s.get(plan.kind, 0.0) + seconds
        inst.kind_steps[plan.kind] = inst.kind_steps.get(plan.kind, 0) + 1
        inst.kind_items[plan.kind] = inst.kind_items.get(plan.kind, 0) + len(plan.chunks) + len(plan.decodes)
        self.events.at(now + seconds, lambda t: self.step_done(inst, t))

    def step_done(self, inst: Instance, now: float) -> None:
        plan = inst.plan
        assert plan is not None
        inst.plan = None
        ended = []
        fudg_prefill = inst.role == "prefill"
        for rid, done, take in plan.chunks:
            r = self.requests[rid]
            if done + take >= inst.scheduler.running[rid].prompt and (r.gen + 1 >= r.output or fudg_prefill):
                ended.append(rid)
        ended += [rid for rid, _ in plan.decodes if self.requests[rid].gen + 1 >= self.requests[rid].output]
        for rid in inst.scheduler.step_done(plan, now, ended):
            r = self.requests[rid]
            r.gen += 1
            if math.isnan(r.first_token):
                r.first_token = now
            r.last_token = now
            if fudg_prefill and r.gen < r.output:
                self.hand_off(inst, r, now)
        if ended or inst.scheduler.preempted:
            inst.scheduler.preempted.clear()
            self.report(inst, now)
        elif now - inst.last_report >= self.o.status_every_s:
            self.report(inst, now)
        self.kick(inst, now)

    def hand_off(self, src: Instance, r: Request, now: float) -> None:
        """FuDG: the prompt's KV to the least-loaded decode instance (DistServe: of its host), over PCIe or the
        NICs."""
        pool = [i for i in self.instances if i.active and i.role == "decode"]
        if self.o.design == "distserve":  # intra-node FuDG: the decode instance beside it, KV over PCIe
            pool = [i for i in pool if i.host == src.host] or pool
        dst = pool[least_loaded([i.scheduler.kv_used + sum(h.prompt for h in i.scheduler.waiting)
                                 for i in pool])]
        nbytes = self.cost.kv_transfer_bytes(r.prompt)
        if dst.host == src.host:
            arrive = self.pcie[src.host].send(now, nbytes)
        else:  # the sender's uplink and the receiver's downlink, both busy for the whole transfer
            up, down = self.up[src.host], self.down[dst.host]
            start = max(now, up.free, down.free)
            up.free = down.free = start + nbytes / up.bytes_per_s
            arrive = up.free + up.latency_s

        def land(t: float) -> None:
            dst.scheduler.adopt(r.rid, r.prompt, t)
            self.kick(dst, t)

        self.events.at(arrive, land)

    def report(self, inst: Instance, now: float) -> None:
        """The instance's state to its macro-instance scheduler, arriving `status_latency_s` later."""
        inst.last_report = now
        if self.overall is None:
            return
        state = inst.scheduler.status()
        overall = self.overall

        def deliver(t: float) -> None:
            with contextlib.suppress(KeyError):  # it left the macro-instances since
                overall.macros[overall.macro_of(inst.index)].update(inst.index, state)

        self.events.at(now + self.o.status_latency_s, deliver)

    # -- mitosis ------------------------------------------------------------------------------------------

    def scale(self, now: float) -> None:
        # The window's verdicts: requests that finished in it, and those still without a decode phase past the
        # TTFT SLO (already missed).
        start = now - self.o.window_s
        finished = [r for r in self.requests if r.finished and start < r.last_token <= now]
        late = [r for r in self.requests if math.isnan(r.decode_start) and not r.finished
                and start < r.arrival + self.slos.ttft_s <= now]
        attained = attainment([r.meets(self.slos) for r in finished], len(late))
        use = self._window_use(now)
        if self.scaler is not None:
            change = self.scaler.window(now, attained, use, lambda k: self.instances[cast(int, k)].scheduler.status())
            if change is not None:
                self.instances[cast(int, change.instance)].active = change.action == "add"
                self.scaling.append({"t": now, "action": change.action, "instance": change.instance,
                                     "attainment": attained, "sizes": list(change.sizes), "moves": len(change.moves)})
        self.events.at(now + self.o.window_s, self.scale)

    def _window_use(self, now: float) -> float:
        busy = []
        for i in self.instances:
            if i.active:
                busy.append(min(1.0, (i.busy_all - i.busy_mark) / self.o.window_s))
            i.busy_mark = i.busy_all
        return sum(busy) / len(busy) if busy else 0.0


def simulate_instances(model: ModelSpec, workload: Workload, options: PadgOptions, *, duration_s: float,
                       warmup_s: float, slos: Slos) -> PadgResult:
    """Serve `workload`'s arrivals in [0, duration_s); measure those arriving in [warmup_s, duration_s)."""
    if workload.offline:
        raise ConfigError("the instance simulator replays online workloads (give --rate)")
    if not 0 <= warmup_s < duration_s:
        raise ConfigError(f"need 0 <= warmup ({warmup_s}) < duration ({duration_s})")
    sim = PadgSim(model, options, slos)
    sim.window = (warmup_s, duration_s)
    for i, t in enumerate(workload.arrivals):
        if t >= duration_s:
            break
        sim.events.at(t, functools.partial(sim.arrive, Request(i, t, workload.inputs[i], workload.outputs[i])))
    if options.max_instances > options.instances:
        sim.events.at(options.window_s, sim.scale)
    sim.events.run(duration_s)
    sim.events.heap = [e for e in sim.events.heap if e[2] != sim.scale]
    heapq.heapify(sim.events.heap)
    sim.events.run(duration_s + options.drain_s)
    busy = [i.busy_s for i in sim.instances if i.active or i.busy_s > 0]
    steps: dict[str, dict[str, float]] = {}
    for inst in sim.instances:
        for kind, secs in inst.kind_s.items():
            cell = steps.setdefault(kind, {"seconds": 0.0, "steps": 0.0, "items": 0.0})
            cell["seconds"] += secs
            cell["steps"] += inst.kind_steps[kind]
            cell["items"] += inst.kind_items[kind]
    for cell in steps.values():
        cell["mean_items"] = cell["items"] / cell["steps"] if cell["steps"] else 0.0
    return PadgResult(options, slos, sim.requests, (warmup_s, duration_s), busy, sim.scaling, steps)
