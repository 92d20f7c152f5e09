"""A roofline cost model of one pipeline stage's step on a device from the papers' GPU tables.

Pure: a step takes the longer of its compute time (2 FLOPs per weight per token, plus attention over the
context) and its memory time (every weight read once, plus the KV of the context), each at an efficiency
share of the device's peak. The testnet uses it to pace emulated devices; the planner uses it for profile
tables when nothing was measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hetnode.planner.devices import DeviceSpec

# Shares of peak that serving kernels reach in practice (memory-bound decode reaches more of its peak): a guess
# from no measurement, kept as the default so that nothing priced before calibration moves.
COMPUTE_EFFICIENCY = 0.5
MEMORY_EFFICIENCY = 0.7


@dataclass(frozen=True)
class Roofline:
    """How a step's roofline turns into seconds: the shares of peak FLOP/s and memory bandwidth reached, and a
    fixed cost that does not shrink with the work (per layer a stage holds, and per step)."""

    compute_efficiency: float = COMPUTE_EFFICIENCY
    memory_efficiency: float = MEMORY_EFFICIENCY
    layer_fixed_s: float = 0.0
    step_fixed_s: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.compute_efficiency <= 1 and 0 < self.memory_efficiency <= 1):
            raise ValueError("efficiencies are shares of peak, in (0, 1]")
        if self.layer_fixed_s < 0 or self.step_fixed_s < 0:
            raise ValueError("fixed costs cannot be negative")


DEFAULT_ROOFLINE = Roofline()
# Fitted on Splitwise's measured step times (Llama-2 70B and BLOOM-176B on DGX-A100 and DGX-H100, TP 2 to 8;
# ../shared/data/splitwise-sim/perf_model.csv, MIT) by `.venv/bin/python scripts/fit_roofline.py`: relative
# RMS error 0.163 over 1,660 steps, against 0.292 for DEFAULT_ROOFLINE. A per-step fixed cost fits as well
# (16.2 ms, 0.164): the data's two models (70 and 80 layers) cannot tell the two apart.
SPLITWISE_ROOFLINE = Roofline(compute_efficiency=0.51, memory_efficiency=0.88, layer_fixed_s=0.206e-3)
ROOFLINES = {"default": DEFAULT_ROOFLINE, "fitted": SPLITWISE_ROOFLINE}


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int

    @property
    def params(self) -> int:
        attn = self.hidden * self.heads * self.head_dim * 2 + self.hidden * self.kv_heads * self.head_dim * 2
        return attn + 3 * self.hidden * self.intermediate

    @property
    def kv_elems_per_token(self) -> int:
        return 2 * self.kv_heads * self.head_dim


class HasLayerShape(Protocol):
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def layer_shape(cfg: HasLayerShape) -> LayerShape:
    return LayerShape(hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, heads=cfg.num_heads,
                      kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)


def _work(layer: LayerShape, layers: int, new_tokens: int, context_tokens: int, attended_pairs: int | None,
          bytes_per_elem: int) -> tuple[float, float]:
    """(FLOPs, bytes) of a step."""
    pairs = new_tokens * context_tokens if attended_pairs is None else attended_pairs
    flops = layers * (2 * layer.params * new_tokens + 4 * layer.heads * layer.head_dim * pairs)
    nbytes = layers * bytes_per_elem * (layer.params + layer.kv_elems_per_token * context_tokens)
    return flops, nbytes


def peak_seconds(device: DeviceSpec, layer: LayerShape, layers: int, new_tokens: int, context_tokens: int,
                 *, attended_pairs: int | None = None, bytes_per_elem: int = 2) -> tuple[float, float]:
    """(compute, memory) seconds of a step at the device's full peaks: what a `Roofline` scales."""
    if layers <= 0 or new_tokens <= 0:
        return 0.0, 0.0
    flops, nbytes = _work(layer, layers, new_tokens, context_tokens, attended_pairs, bytes_per_elem)
    return flops / (device.fp16_tflops * 1e12), nbytes / (device.mem_bandwidth_gbps * 1e9)


def step_time(device: DeviceSpec, layer: LayerShape, layers: int, new_tokens: int, context_tokens: int,
              *, attended_pairs: int | None = None, bytes_per_elem: int = 2,
              roofline: Roofline = DEFAULT_ROOFLINE) -> float:
    """Seconds for `layers` layers to process `new_tokens` with `context_tokens` of KV in the batch.

    attended_pairs is the sum over the batch's items of new tokens x context (default: one item)."""
    if layers <= 0 or new_tokens <= 0:
        return 0.0
    flops, nbytes = _work(layer, layers, new_tokens, context_tokens, attended_pairs, bytes_per_elem)
    compute = flops / (device.fp16_tflops * 1e12 * roofline.compute_efficiency)
    memory = nbytes / (device.mem_bandwidth_gbps * 1e9 * roofline.memory_efficiency)
    return max(compute, memory) + layers * roofline.layer_fixed_s + roofline.step_fixed_s
