"""What one step of a tensor-parallel instance costs: the roofline of its GPUs plus TP's all-reduces.

EcoServe (§4) serves each model on instances of `tp` GPUs of one host (Table 4's degrees: TP=4 for the 30B and
34B models, TP=8 for Qwen2-72B on L20s). A step of such an instance is priced the way the ThunderServe planner
prices a stage (planner/thunderserve/parallel.py): `costmodel.step_time` of the tp GPUs as one device (FLOP/s,
memory and bandwidth summed), plus two ring all-reduces of the step's activations per layer over the host's
GPU link. EcoServe's L20 hosts have no NVLink, so that link is PCIe; §2.3 reports that on four L20s
communication takes "nearly half" of Llama-30B's execution time, which `comm_share` lets a caller check.

A step carries prompt tokens (each attending to its own prefix and the context before it) and decode items
(each one new token attending to its context); the weights are read once for the whole step, as one batched
forward pass does (Sarathi's hybrid batches, and a pure prefill or decode batch alike).

Pure: numbers in, seconds out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hetnode.planner.all_reduce import ring_all_reduce_s
from hetnode.planner.cluster import PCIE_LINK
from hetnode.planner.costmodel import DEFAULT_ROOFLINE, Roofline, step_time
from hetnode.planner.devices import DeviceSpec
from hetnode.planner.model import ModelSpec

# The GPU link of a host without NVLink: PCIe 4.0 x16 peer to peer as NCCL measures it (cluster.PCIE_LINK, the
# cluster files' default between GPUs of one host), in GB/s and seconds per message.
PCIE_GBPS = PCIE_LINK.bandwidth_mbps / 8000
PCIE_LATENCY_S = PCIE_LINK.latency_ms / 1000
KV_RESERVE = 0.1  # share of memory kept free beside weights and KV (activations, CUDA graphs, fragmentation)


@dataclass(frozen=True)
class Chunk:
    """Prompt tokens [done, done + tokens) of one request in a step."""

    tokens: int
    done: int = 0  # tokens of this prompt prefilled by earlier steps (a chunked prefill's context)


@dataclass(frozen=True)
class InstanceCost:
    """One instance: `tp` GPUs of `device` (a single-GPU spec) holding the whole model."""

    device: DeviceSpec
    tp: int
    model: ModelSpec
    link_gbps: float = PCIE_GBPS
    link_latency_s: float = PCIE_LATENCY_S
    roofline: Roofline = DEFAULT_ROOFLINE

    def __post_init__(self) -> None:
        if self.device.count != 1:
            raise ValueError(f"give the single-GPU spec, not {self.device.name}")
        if self.tp < 1 or self.model.num_heads % self.tp or self.model.num_kv_heads % self.tp:
            raise ValueError(f"TP {self.tp} must divide {self.model.name}'s heads ({self.model.num_heads}) and KV "
                             f"heads ({self.model.num_kv_heads})")

    @property
    def group(self) -> DeviceSpec:
        return self.device.times(self.tp)

    @property
    def kv_tokens(self) -> int:
        """Tokens of KV the instance holds beside the weights."""
        model = self.model
        free = self.group.memory_bytes * (1 - KV_RESERVE) - model.layer_bytes * model.num_layers
        return max(0, int(free // (model.kv_bytes_per_token_layer * model.num_layers)))

    def all_reduce_s(self, tokens: int) -> float:
        """A ring all-reduce of `tokens` activations among the tp GPUs: 2(tp-1) steps of 1/tp of the bytes."""
        return ring_all_reduce_s(self.tp, tokens * self.model.activation_bytes, self.link_gbps * 1e9,
                                 self.link_latency_s)

    def step_s(self, chunks: Sequence[Chunk] = (), decode_contexts: Sequence[int] = ()) -> float:
        """Seconds for one step: prompt `chunks` and decode items whose contexts (tokens attended) are given."""
        new = sum(c.tokens for c in chunks) + len(decode_contexts)
        if new <= 0:
            return 0.0
        # Attention: a chunk's token i attends to done + i + 1 positions; a decode item to its context.
        pairs = sum(c.tokens * c.done + c.tokens * (c.tokens + 1) // 2 for c in chunks) + sum(decode_contexts)
        # KV read: every context position once per step (a chunk reads its prefix and its own).
        context = sum(c.done + c.tokens for c in chunks) + sum(decode_contexts)
        compute = step_time(self.group, self.model.shape, self.model.num_layers, new, context,
                            attended_pairs=pairs, bytes_per_elem=round(self.model.bytes_per_param),
                            roofline=self.roofline)
        return compute + 2 * self.model.num_layers * self.all_reduce_s(new)

    def prefill_s(self, prompt: int) -> float:
        return self.step_s([Chunk(prompt)])

    def comm_share(self, chunks: Sequence[Chunk] = (), decode_contexts: Sequence[int] = ()) -> float:
        """The share of a step's time that is TP communication."""
        total = self.step_s(chunks, decode_contexts)
        new = sum(c.tokens for c in chunks) + len(decode_contexts)
        return 2 * self.model.num_layers * self.all_reduce_s(new) / total if total > 0 else 0.0

    def kv_transfer_bytes(self, tokens: int) -> float:
        """Bytes of a request's KV for `tokens` tokens (what a FuDG design moves from prefill to decode)."""
        return tokens * self.model.kv_bytes_per_token_layer * self.model.num_layers

    @property
    def decode_floor_s(self) -> float:
        """The memory-bound floor of any step: reading the weights once (and the step's fixed costs)."""
        weights = self.model.layer_bytes * self.model.num_layers
        r = self.roofline
        return (weights / (self.group.mem_bandwidth_gbps * 1e9 * r.memory_efficiency)
                + self.model.num_layers * r.layer_fixed_s + r.step_fixed_s)
