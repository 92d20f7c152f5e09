"""Profile tables: how fast a device runs a model's layers, and how many it can hold.

A `DeviceProfile` keeps per-layer step times, the way Helix's artifact measured them with vLLM: the time for
ONE layer to run a prompt batch of n tokens, and one decode step of a batch of b sequences (plus, where the
source knows it, a cost per token of context). The planner reads from it T_j, the tokens per second a node
holding j layers sustains (Helix §4.4, constraint 3); the simulator reads the step times.

T_j follows Helix's artifact: tokens are prompt and decode tokens alike (each crosses a node once, which is
what one unit of flow is), measured on a typical request of `input_len` prompt tokens and `output_len`
generated tokens. Per request a node spends j x (prefill of input_len tokens + output_len decode steps, each
shared with the batch), and the decode batch is as large as the KV memory left after j layers' weights
allows, up to `max_batch`:

    B_j = min(max_batch, kv_tokens(j) / (input_len + output_len / 2))
    T_j = (input_len + output_len) / (j x (prefill(input_len) + output_len x decode(B_j) / B_j))

That is a node serving alone. In a pipeline it is not: a request's KV sits on every stage it passes while its
token is at one stage only, so a node's decode batch is the requests its KV holds times the share of a
request's round trip it spends there. `pipeline_throughputs` computes T_j that way, as Helix's simulator does
(`llama70b_workload_ratio` and `llama70b_typical_statistics` in its artifact), for the nodes of one cluster:

    ratio_j = j t / ((L - j) t_avg + j t)      t: this node's time per layer; t_avg: the cluster's, by layer
    B_j     = min(max_batch, kv_fill x kv_tokens(j) / (input_len + output_len) x ratio_j)

t and t_avg come from the cluster's own T at a typical layer count, so it is a fixed point; ten rounds
settle it (Helix's artifact iterates ten times too). `profile_table_for(..., in_pipeline=True)` gives the
planner these T_j; it is not the default because, measured by scripts/reproduce_helix.py, the planner then
chose deeper plans that served less in the simulator (docs/reproducing-helix.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from hetnode.errors import ConfigError
from hetnode.planner.all_reduce import tp_layer_s
from hetnode.planner.cluster import PCIE_LINK, LinkSpec
from hetnode.planner.costmodel import step_time
from hetnode.planner.devices import DeviceSpec
from hetnode.planner.model import ModelSpec
from hetnode.planner.node_limits import NodeLimits, limits_for

Curve = tuple[tuple[float, float], ...]  # sorted (x, seconds per layer) points; linear between them


@dataclass(frozen=True)
class Workload:
    """The typical request T_j is measured on (Helix's simulator: 750 in, 240 out)."""

    input_len: int = 750
    output_len: int = 240
    max_batch: int = 256  # the most sequences one decode step batches
    # The share of a node's KV that holds requests in steady state: the scheduler's high-water mark (the
    # runtime's 0.9; Helix's planner's T_j estimate used 0.3, KV_CACHE_HWM, while its scheduler masked at 0.85
    # offline and 0.9 online). Only pipeline_throughputs uses it.
    kv_fill: float = 0.9

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 0 or self.max_batch < 1 or not 0 < self.kv_fill <= 1:
            raise ConfigError(f"bad workload: {self} (input_len >= 1, output_len >= 0, max_batch >= 1, "
                              "0 < kv_fill <= 1)")


def interpolate(curve: Curve, x: float) -> float:
    """Linear between points, linear through the origin below the first, and extrapolated past the last."""
    xs = [p[0] for p in curve]
    i = bisect.bisect_left(xs, x)
    if i < len(curve) and curve[i][0] == x:
        return curve[i][1]
    if i == 0:
        x1, y1 = curve[0]
        return y1 * x / x1 if x1 > 0 else y1
    if i == len(curve):
        (x0, y0), (x1, y1) = curve[-2] if len(curve) > 1 else (0.0, 0.0), curve[-1]
        slope = (y1 - y0) / (x1 - x0) if x1 > x0 else 0.0
        return y1 + slope * (x - x1)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


@dataclass(frozen=True)
class DeviceProfile:
    name: str  # the device type ("a100", "2xl4") or node name the profile is for
    memory_bytes: int
    max_layers: int  # k: the most layers it holds with the configured share of memory kept for KV
    prompt_curve: Curve  # (prompt tokens in the batch, seconds per layer)
    decode_curve: Curve  # (sequences in the decode batch, seconds per layer)
    decode_context_s: float = 0.0  # extra seconds per layer per token of context in a decode batch
    throughput: tuple[float, ...] = ()  # T_1..T_k in tokens/s
    source: str = ""
    throughput_given: bool = False  # T came from a file as numbers: kept as given, never recomputed
    # Measured KV pool and step caps for 1, 2, ... layers held (node_limits.py); empty: not measured.
    limits: tuple[NodeLimits, ...] = ()

    def prefill_time(self, tokens: int, layers: int) -> float:
        return layers * interpolate(self.prompt_curve, tokens) if tokens > 0 else 0.0

    def decode_time(self, batch: int, layers: int, context_tokens: int = 0) -> float:
        if batch <= 0:
            return 0.0
        return layers * (interpolate(self.decode_curve, batch) + self.decode_context_s * context_tokens)

    def tokens_per_s(self, layers: int) -> float:
        """T_j; 0 for a layer count it cannot hold."""
        return self.throughput[layers - 1] if 1 <= layers <= len(self.throughput) else 0.0


def kv_tokens(memory_bytes: int, model: ModelSpec, layers: int) -> int:
    """Tokens of KV that fit beside `layers` layers of weights."""
    free = memory_bytes - layers * model.layer_bytes
    return max(0, int(free // (model.kv_bytes_per_token_layer * layers)))


def node_kv_tokens(profile: DeviceProfile, model: ModelSpec, layers: int, *, measured: bool = True,
                   past: str = "estimate") -> int:
    """A node's KV tokens: its measured pool where the profile has one for `layers` (and `measured` asks for
    it; past the table as `node_limits.limits_for` says), else what its memory leaves beside the weights."""
    found = limits_for(profile.limits, layers, past) if measured else None
    return found.kv_tokens if found is not None else kv_tokens(profile.memory_bytes, model, layers)


def max_layers_for(memory_bytes: int, model: ModelSpec, kv_share: float) -> int:
    return min(model.num_layers, int(memory_bytes * (1 - kv_share) // model.layer_bytes))


def tokens_per_s_at(profile: DeviceProfile, workload: Workload, j: int, batch: float) -> float:
    """T for j layers at a decode batch of `batch` sequences (fractional batches price by interpolation)."""
    batch = max(1.0, min(float(workload.max_batch), batch))
    context = workload.input_len + workload.output_len // 2
    per_layer = (interpolate(profile.prompt_curve, workload.input_len)
                 + workload.output_len * (interpolate(profile.decode_curve, batch)
                                          + profile.decode_context_s * context * batch) / batch)
    return (workload.input_len + workload.output_len) / (j * per_layer)


def alone_batch(profile: DeviceProfile, model: ModelSpec, workload: Workload, j: int) -> int:
    """The decode batch T_j assumes for a node alone: as many typical requests as its KV holds."""
    return int(kv_tokens(profile.memory_bytes, model, j) / (workload.input_len + workload.output_len / 2))


def throughputs(profile: DeviceProfile, model: ModelSpec, workload: Workload) -> tuple[float, ...]:
    """T_1..T_k of the node serving alone: its whole KV decodes as one batch."""
    return tuple(tokens_per_s_at(profile, workload, j, alone_batch(profile, model, workload, j))
                 for j in range(1, profile.max_layers + 1))


def typical_layers(profiles: Mapping[str, DeviceProfile], counts: Mapping[str, int], num_layers: int) -> dict[str, int]:
    """Layers a node of each profile typically holds: two thirds of its most, or its most when the cluster has
    little room to spare (Helix's artifact: a table by GPU type, which this rule reproduces to within one)."""
    typical = {k: max(1, round(2 * p.max_layers / 3)) for k, p in profiles.items()}
    if sum(counts[k] * typical[k] for k in profiles) < 1.2 * num_layers:
        typical = {k: p.max_layers for k, p in profiles.items()}
    return typical


def pipeline_throughputs(profiles: Mapping[str, DeviceProfile], counts: Mapping[str, int], model: ModelSpec,
                         workload: Workload, *, rounds: int = 10) -> dict[str, DeviceProfile]:
    """The profiles with T_j of a node inside this cluster's pipelines (module docstring); `counts` says how
    many nodes use each profile. Profiles that cannot hold a layer, or whose T a file gave, keep their T."""
    live = {k: p for k, p in profiles.items()
            if p.max_layers >= 1 and counts.get(k, 0) > 0 and not p.throughput_given}
    if not live:
        return dict(profiles)
    num_layers = model.num_layers
    typical = typical_layers(live, counts, num_layers)
    seq = workload.input_len + workload.output_len

    def tokens_per_s(k: str, j: int, avg_layer_s: float, layer_s: float) -> float:
        mine = j * layer_s
        ratio = mine / (max(0, num_layers - j) * avg_layer_s + mine)
        batch = workload.kv_fill * kv_tokens(live[k].memory_bytes, model, j) / seq * ratio
        return tokens_per_s_at(live[k], workload, j, batch)

    # Seconds per layer per token at the typical count, starting from the node alone.
    layer_s = {k: 1.0 / (throughputs(p, model, workload)[typical[k] - 1] * typical[k]) for k, p in live.items()}
    weight = {k: counts[k] * typical[k] for k in live}
    avg = 0.0
    for _ in range(rounds):
        avg = sum(weight[k] * layer_s[k] for k in live) / sum(weight.values())
        layer_s = {k: 1.0 / (tokens_per_s(k, typical[k], avg, layer_s[k]) * typical[k]) for k in live}
    out = dict(profiles)
    for k, p in live.items():
        # A node holding j layers spends j/typical of its typical time per layer on them: j x layer time at
        # j layers is what tokens_per_s prices, so the ratio uses the per-layer time at the typical count.
        out[k] = replace(p, throughput=tuple(tokens_per_s(k, j, avg, layer_s[k])
                                             for j in range(1, p.max_layers + 1)))
    return out


def with_throughput(profile: DeviceProfile, model: ModelSpec, workload: Workload) -> DeviceProfile:
    return DeviceProfile(name=profile.name, memory_bytes=profile.memory_bytes, max_layers=profile.max_layers,
                         prompt_curve=profile.prompt_curve, decode_curve=profile.decode_curve,
                         decode_context_s=profile.decode_context_s,
                         throughput=throughputs(profile, model, workload), source=profile.source,
                         limits=profile.limits)


_PROMPT_POINTS = (1, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_DECODE_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def roofline_profile(device: DeviceSpec, model: ModelSpec, *, kv_share: float = 0.5,
                     workload: Workload | None = None, memory_bytes: int | None = None,
                     gpu_link: LinkSpec | None = None) -> DeviceProfile:
    """A profile from the roofline cost model of the device's table numbers.

    A device of several GPUs ("4xa6000") runs each layer tensor parallel over them, so every prompt and decode
    step of a layer also pays its two ring all-reduces (`all_reduce.tp_layer_s`, tp = the GPU count), over
    `gpu_link`, the link among its GPUs. A node of a cluster file names none of its own (`NodeSpec.gpu_link`):
    None is the cluster files' PCIe link between GPUs of one host (`cluster.PCIE_LINK`, 16 GB/s, 10 us). This
    is the one place the roofline charges them: ThunderServe's planner (`thunderserve.parallel`) and EcoServe's
    instances (`instance_cost`) price from `costmodel.step_time` and charge their own with the same function,
    and the simulator's merged TP stages carry the link between the stage's GPUs on their node
    (`testnet.sim.tp_stages`). Measured profiles (Helix's vLLM tables, Splitwise's performance model) include
    their all-reduces already and pay nothing more. The all-reduce is affine in the step's tokens, so adding it
    at the curves' points prices every step between them exactly."""
    shape = model.shape
    memory = device.memory_bytes if memory_bytes is None else memory_bytes
    bpe = round(model.bytes_per_param)
    link = gpu_link or PCIE_LINK
    bps, latency = link.bytes_per_s, link.latency_s

    def all_reduces(tokens: int) -> float:
        return tp_layer_s(device.count, tokens, model.activation_bytes, bps, latency)

    prompt = tuple((float(n), step_time(device, shape, 1, n, n, attended_pairs=n * (n + 1) // 2,
                                        bytes_per_elem=bpe) + all_reduces(n)) for n in _PROMPT_POINTS)
    decode = tuple((float(b), step_time(device, shape, 1, b, 0, bytes_per_elem=bpe) + all_reduces(b))
                   for b in _DECODE_POINTS)
    # Decode reads each context token's KV once per step: the memory-bound cost of context.
    context_s = model.kv_bytes_per_token_layer / (device.mem_bandwidth_gbps * 1e9 * 0.7)
    charged = (f", with TP-{device.count} all-reduces at {link.bandwidth_mbps / 1000:g} Gb/s"
               if device.count > 1 else "")
    base = DeviceProfile(name=device.name, memory_bytes=memory, max_layers=max_layers_for(memory, model, kv_share),
                         prompt_curve=prompt, decode_curve=decode, decode_context_s=context_s,
                         source=f"roofline of {device.name} ({device.source}){charged}")
    return with_throughput(base, model, workload or Workload())


@dataclass(frozen=True)
class ProfileTable:
    """Profiles by node name or by device type; a node's own entry wins over its type's."""

    model: str
    profiles: Mapping[str, DeviceProfile] = field(default_factory=dict, hash=False)
    source: str = ""

    def for_node(self, node: str, device: str) -> DeviceProfile:
        found = self.profiles.get(node) or self.profiles.get(device)
        if found is None:
            raise ConfigError(f"the profile table ({self.source or 'given'}) has no entry for node {node!r} "
                              f"or its device type {device!r}; it has: {', '.join(sorted(self.profiles))}")
        return found
