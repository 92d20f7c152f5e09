"""What tensor parallelism's all-reduces cost: one function for the planners and the simulator.

A stage (or instance) of d tensor-parallel GPUs ends its attention and its MLP of every layer with a ring
all-reduce of the step's activations (Megatron-LM's split: two per layer), 2(d-1) steps each moving 1/d of the
bytes over the GPUs' link (alpha-beta). ThunderServe's planner (`thunderserve.parallel`), EcoServe's instance
cost (`instance_cost`) and the simulator's TP stages (`testnet.sim.tp_stages`) all price them here, so that a
plan's TP stage costs the same in the planner and in the simulator.

Pure: numbers in, seconds out.
"""

from __future__ import annotations

import math

ALL_REDUCES_PER_LAYER = 2  # after attention and after the MLP


def ring_all_reduce_s(parties: int, nbytes: float, bandwidth_bps: float, latency_s: float) -> float:
    """A ring all-reduce of `nbytes` among `parties` GPUs over a link of `bandwidth_bps` bytes/s and `latency_s`
    seconds a message: 2(parties - 1) steps of nbytes / parties (0 for one GPU; inf without a link)."""
    if parties <= 1 or nbytes <= 0:
        return 0.0
    if not bandwidth_bps > 0:
        return math.inf
    return 2 * (parties - 1) * (latency_s + nbytes / parties / bandwidth_bps)


def tp_layer_s(parties: int, tokens: float, activation_bytes: float, bandwidth_bps: float,
               latency_s: float) -> float:
    """Seconds of all-reduce one layer adds to a step of `tokens` new tokens on `parties` TP GPUs."""
    return ALL_REDUCES_PER_LAYER * ring_all_reduce_s(parties, tokens * activation_bytes, bandwidth_bps, latency_s)
