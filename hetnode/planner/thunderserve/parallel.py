"""A group's parallel configuration (Appendix B, Algorithm 2) and what it costs in each phase.

For a group of GPUs and its phase:

1. Tensor parallel degrees d: TP only among GPUs of one host and one type (Appendix B's first heuristic), so
   the group's GPUs fall into cells (host, type) and d must divide every cell's count (each cell then holds
   count/d TP units, no GPU idle; the paper bounds d by the least cell count and lets PP = GPUs/d) and the
   model's attention and KV heads (a head is not split). The pipeline has one stage per unit: PP = GPUs / d.
2. Stage order: the units of each host together, hosts in the order stage_order.best_order finds.
3. Layer partition: non-uniform, in proportion to a mix of each stage's memory and its speed in the phase
   (FLOP/s for prefill, memory bandwidth for decode), never more than a stage's GPUs hold beside
   `kv_reserve` of their memory.
4. Prefill groups take the latency-optimal configuration (least time for one prompt of the mean length,
   then the higher rate); decode groups the throughput-optimal one (most tokens per second at the batch
   their KV holds).

Costs come from the roofline model (costmodel.step_time) of a stage's d GPUs as one device, plus tensor
parallelism's two ring all-reduces per layer over the host's link (`all_reduce`, which the simulator's TP
stages charge too) and pipeline hops at alpha-beta over the
links between stages. `Performance` prices a layout in both phases, so lightweight rescheduling can flip a
group's phase without re-deriving its layout (§3.4).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

from hetnode.planner.all_reduce import tp_layer_s
from hetnode.planner.costmodel import LayerShape, step_time
from hetnode.planner.devices import DeviceSpec
from hetnode.planner.model import ModelSpec
from hetnode.planner.thunderserve.gpus import GpuPool
from hetnode.planner.thunderserve.settings import ThunderServeOptions
from hetnode.planner.thunderserve.stage_order import best_order

PREFILL = "prefill"
DECODE = "decode"
ROLES = (PREFILL, DECODE)


@dataclass(frozen=True)
class Stage:
    gpus: tuple[int, ...]  # pool indices: d GPUs of one host and one type, tensor parallel
    first_layer: int
    last_layer: int  # exclusive

    @property
    def layers(self) -> int:
        return self.last_layer - self.first_layer


@dataclass(frozen=True)
class Layout:
    tp: int
    stages: tuple[Stage, ...]  # in layer order

    @property
    def gpus(self) -> tuple[int, ...]:
        return tuple(g for s in self.stages for g in s.gpus)


@dataclass(frozen=True)
class Performance:
    """A layout's costs at the traffic's mean lengths, in both phases."""

    prefill_s: float  # one prompt, first stage to last
    prefill_rate: float  # prompts per second the pipeline sustains (its slowest stage or hop)
    max_batch: int  # sequences its KV holds at the mean context (0: it cannot decode)
    tpot: tuple[tuple[int, float], ...]  # (batch, seconds per decode step of every sequence), rising batch
    decode_rate: float  # requests per second at max_batch
    kv_tokens: float = math.inf  # tokens of KV its tightest stage holds beside its layers (`decode_queue`)

    def tpot_at(self, batch: float) -> float:
        """Seconds per output token at a decode batch, linear between the points."""
        xs = [b for b, _ in self.tpot]
        i = bisect.bisect_left(xs, batch)
        if i == 0:
            return self.tpot[0][1]
        if i == len(xs):
            return self.tpot[-1][1]
        (b0, t0), (b1, t1) = self.tpot[i - 1], self.tpot[i]
        return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)


@dataclass(frozen=True)
class Configured:
    layout: Layout
    performance: Performance


def tp_degrees(pool: GpuPool, gpus: tuple[int, ...], model: ModelSpec) -> list[int]:
    cells = _cells(pool, gpus)
    least = min(len(c) for c in cells.values())
    return [d for d in range(1, least + 1)
            if all(len(c) % d == 0 for c in cells.values())
            and model.num_heads % d == 0 and model.num_kv_heads % d == 0]


def configure(pool: GpuPool, gpus: tuple[int, ...], role: str, model: ModelSpec,
              options: ThunderServeOptions) -> Configured | None:
    """The best layout of `gpus` for `role` (module docstring), or None when no layout holds the model."""
    best: tuple[tuple[float, float], Configured] | None = None
    for d in tp_degrees(pool, gpus, model):
        layout = lay_out(pool, gpus, d, role, model, options)
        if layout is None:
            continue
        perf = performance(pool, layout, model, options)
        key = (perf.prefill_s, -perf.prefill_rate) if role == PREFILL else (-perf.decode_rate, perf.tpot[0][1])
        if perf.max_batch < 1 or not math.isfinite(key[0]):
            continue
        if best is None or key < best[0]:
            best = (key, Configured(layout, perf))
    return None if best is None else best[1]


def lay_out(pool: GpuPool, gpus: tuple[int, ...], tp: int, role: str, model: ModelSpec,
            options: ThunderServeOptions) -> Layout | None:
    """Stages of `tp` GPUs, hosts in their best order, layers split by memory and speed; None if they
    cannot hold the model."""
    cells = _cells(pool, gpus)
    hosts = sorted({pool.gpus[g].host for g in gpus})
    units_by_host: dict[str, list[tuple[int, ...]]] = {h: [] for h in hosts}
    for (host, _), members in sorted(cells.items()):
        units_by_host[host] += [tuple(members[k:k + tp]) for k in range(0, len(members), tp)]
    act = options.traffic.input_len * model.activation_bytes
    lead = [units_by_host[h][0][0] for h in hosts]
    cost = [[pool.hop_seconds(a, b, act) for b in lead] for a in lead]
    order, _ = best_order(cost)
    units = [u for k in order for u in units_by_host[hosts[k]]]
    if len(units) > model.num_layers:
        return None
    caps = [int(tp * min(pool.gpus[g].memory_bytes for g in u) * (1 - options.kv_reserve) // model.layer_bytes)
            for u in units]
    mem = [float(sum(pool.gpus[g].memory_bytes for g in u)) for u in units]
    speed = [tp * (_device(pool, u[0]).fp16_tflops if role == PREFILL else _device(pool, u[0]).mem_bandwidth_gbps)
             for u in units]
    weights = [0.5 * m / sum(mem) + 0.5 * s / sum(speed) for m, s in zip(mem, speed, strict=True)]
    counts = partition(model.num_layers, weights, caps)
    if counts is None:
        return None
    stages = []
    first = 0
    for u, c in zip(units, counts, strict=True):
        stages.append(Stage(u, first, first + c))
        first += c
    return Layout(tp=tp, stages=tuple(stages))


def partition(total: int, weights: list[float], caps: list[int]) -> list[int] | None:
    """`total` layers in proportion to `weights`, at least one and at most caps[i] each; None if the caps
    cannot hold them. Shares over a cap are capped and the rest shared again (water filling), then rounded
    by largest remainders."""
    n = len(weights)
    if n == 0 or n > total or sum(caps) < total or min(caps) < 1:
        return None
    share = [0.0] * n
    free = set(range(n))
    left = float(total)
    while free:
        w = sum(weights[i] for i in free)
        over = [i for i in sorted(free) if left * weights[i] / w > caps[i]]
        if not over:
            for i in free:
                share[i] = left * weights[i] / w
            break
        for i in over:
            share[i] = caps[i]
            left -= caps[i]
            free.remove(i)
    counts = [max(1, min(caps[i], math.floor(share[i]))) for i in range(n)]
    while sum(counts) < total:
        i = max((i for i in range(n) if counts[i] < caps[i]), key=lambda i: (share[i] - counts[i], -i))
        counts[i] += 1
    while sum(counts) > total:
        i = max((i for i in range(n) if counts[i] > 1), key=lambda i: (counts[i] - share[i], -i))
        counts[i] -= 1
    return counts


def performance(pool: GpuPool, layout: Layout, model: ModelSpec, options: ThunderServeOptions) -> Performance:
    traffic = options.traffic
    s_in = max(1, round(traffic.input_len))
    # The context a decoding request holds on average over its time in the batch (Little's law: a request holds
    # L + t tokens for each of its O steps, so the KV in use is lambda E[L O + O^2 / 2] steps' worth): long outputs
    # stay longer, so with lengths that vary it is more than the mean prompt plus half the mean output.
    context = traffic.input_len + traffic.output_len * (1 + traffic.output_cv ** 2) / 2
    stages = layout.stages
    hops = list(itertools.pairwise(stages))
    shape = model.shape  # a property that builds a new object: built once, not per step
    devices = {s: _device(pool, s.gpus[0], len(s.gpus)) for s in stages}

    def stage_s(stage: Stage, tokens: float, ctx: float, pairs: float) -> float:
        return _stage_s(pool, stage, devices[stage], shape, model, tokens, ctx, pairs)

    def hop_s(a: Stage, b: Stage, tokens: float) -> float:
        return pool.hop_seconds(a.gpus[0], b.gpus[0], tokens * model.activation_bytes)

    stations = prefill_stations(pool, layout, model, s_in)
    prefill_s = sum(stations)
    slowest = max(stations)
    prefill_rate = 1 / slowest if slowest > 0 else math.inf

    kv_per_token = model.kv_bytes_per_token_layer
    holds = []
    for s in stages:
        memory = len(s.gpus) * min(pool.gpus[g].memory_bytes for g in s.gpus)
        holds.append((memory - s.layers * model.layer_bytes) / (s.layers * kv_per_token))
    max_batch = max(0, min(options.max_batch, math.floor(min(holds) / context)))

    def cycle(batch: int) -> float:
        # Micro-batches in flight: one more than stages in a pipeline. The batch loop (the runtime's policy, which
        # the simulator runs) starts a step whenever its stage is idle, so a request that arrives in a gap between
        # two micro-batches starts one more, until no stage is ever idle; they then never meet to merge. Measured
        # in the simulator on two-stage decode replicas: stages 95-98% busy, 2.8 steps a token (one a stage would
        # be 2: TPOT 55 ms against 39 priced; docs/reproducing-thunderserve.md, fifteenth part). Not measured on
        # deeper ones.
        micro = min(len(stages) + (1 if len(stages) > 1 else 0), batch)
        mb = batch / micro
        times = [stage_s(s, mb, mb * context, mb * context) for s in stages]
        hop = [hop_s(a, b, mb) for a, b in hops]
        return max(sum(times) + sum(hop), micro * max(times + hop))

    points = sorted({1, max_batch} | {2**k for k in range(1, 10) if 2**k < max_batch}) if max_batch >= 1 else [1]
    tpot = tuple((b, cycle(b)) for b in points)
    decode_rate = max_batch / tpot[-1][1] / traffic.output_len if max_batch >= 1 else 0.0
    return Performance(prefill_s=prefill_s, prefill_rate=prefill_rate, max_batch=max_batch, tpot=tpot,
                       kv_tokens=max(0.0, min(holds)),
                       decode_rate=decode_rate)


def prefill_stations(pool: GpuPool, layout: Layout, model: ModelSpec, tokens: int) -> list[float]:
    """Seconds one prompt of `tokens` spends at each station of the pipeline, in the order it visits them: stage
    0, the hop to stage 1, stage 1, ... (`first_token` queues prompts at each)."""
    shape = model.shape
    out: list[float] = []
    for k, stage in enumerate(layout.stages):
        if k:
            out.append(pool.hop_seconds(layout.stages[k - 1].gpus[0], stage.gpus[0], tokens * model.activation_bytes))
        out.append(_stage_s(pool, stage, _device(pool, stage.gpus[0], len(stage.gpus)), shape, model, tokens, tokens,
                            tokens * (tokens + 1) / 2))
    return out


def _stage_s(pool: GpuPool, stage: Stage, device: DeviceSpec, shape: LayerShape, model: ModelSpec, tokens: float,
             ctx: float, pairs: float) -> float:
    """One step of a stage: its layers' roofline time and their all-reduces."""
    compute = step_time(device, shape, stage.layers, max(1, round(tokens)), round(ctx), attended_pairs=round(pairs),
                        bytes_per_elem=round(model.bytes_per_param))
    return compute + _all_reduce_layer_s(pool, stage, tokens, model.activation_bytes) * stage.layers


def _cells(pool: GpuPool, gpus: tuple[int, ...]) -> dict[tuple[str, str], list[int]]:
    cells: dict[tuple[str, str], list[int]] = {}
    for g in sorted(gpus):
        cells.setdefault((pool.gpus[g].host, pool.gpus[g].kind), []).append(g)
    return cells


def _device(pool: GpuPool, gpu: int, count: int = 1) -> DeviceSpec:
    """`count` GPUs like `gpu` as one device (its own spec when count is 1: a "4xa6000" node stays whole)."""
    device = pool.gpus[gpu].device
    return device if count == 1 else device.per_device().times(count * device.count)


def _all_reduce_layer_s(pool: GpuPool, stage: Stage, tokens: float, activation_bytes: float) -> float:
    """A layer's all-reduces among a stage's GPUs (`all_reduce.tp_layer_s`): every GPU of its nodes is a party
    (a "4xa6000" node is four), and the ring runs at its slowest link, the host's between the nodes or the
    one inside a multi-GPU node (`Gpu.gpu_link`), as the simulator's roofline of that node charges it."""
    first = pool.gpus[stage.gpus[0]]
    parties = len(stage.gpus) * first.device.count
    if parties == 1:
        return 0.0
    bps, latency = math.inf, 0.0
    if first.device.count > 1:
        bps, latency = first.gpu_link.bytes_per_s, first.gpu_link.latency_s
    if len(stage.gpus) > 1:
        a, b = stage.gpus[0], stage.gpus[1]
        bps, latency = min(bps, pool.bandwidth[a][b]), max(latency, pool.latency[a][b])
    return tp_layer_s(parties, tokens, activation_bytes, bps, latency)
