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

# Shares of peak that serving kernels reach in practice (memory-bound decode reaches more of its peak).
COMPUTE_EFFICIENCY = 0.5
MEMORY_EFFICIENCY = 0.7


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


def step_time(device: DeviceSpec, layer: LayerShape, layers: int, new_tokens: int, context_tokens: int,
              *, attended_pairs: int | None = None, bytes_per_elem: int = 2) -> float:
    """Seconds for `layers` layers to process `new_tokens` with `context_tokens` of KV in the batch.

    attended_pairs is the sum over the batch's items of new tokens x context (default: one item)."""
    if layers <= 0 or new_tokens <= 0:
        return 0.0
    pairs = new_tokens * context_tokens if attended_pairs is None else attended_pairs
    flops = layers * (2 * layer.params * new_tokens + 4 * layer.heads * layer.head_dim * pairs)
    nbytes = layers * bytes_per_elem * (layer.params + layer.kv_elems_per_token * context_tokens)
    compute = flops / (device.fp16_tflops * 1e12 * COMPUTE_EFFICIENCY)
    memory = nbytes / (device.mem_bandwidth_gbps * 1e9 * MEMORY_EFFICIENCY)
    return max(compute, memory)
