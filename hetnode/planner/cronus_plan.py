"""Cronus's placement: nodes in pairs of a low-end and a high-end one, each holding the whole model (§4.2).

Nodes are ranked by FP16 FLOP/s (the prefill's measure, and the one §5.1 splits pipelines by); the weakest is
paired with the strongest, the next weakest with the next strongest, and so on, so that every pair has one
node to prefill beginnings (the PPI, the weaker) and one to finish prompts and decode (the CPI). The plan's
replicas list each pair as a "ppi" replica then a "cpi" one, which `coordinator/cronus_scheduler.py` routes. An
odd node out, or a node that cannot hold the whole model, holds nothing. `cronus_splitters` fits each pair's
balancer on its two nodes' reported numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from hetnode.errors import ConfigError
from hetnode.planner.cronus_fit import fit_chunked_iteration, fit_partial_prefill
from hetnode.planner.devices import DeviceSpec
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.policy.cronus import CronusBalancer

CHUNK = 512  # the CPI's token budget per iteration (§5.1)


def cronus_placement(cluster: str, model: ModelSpec, tflops: Mapping[str, float],
                     memory_bytes: Mapping[str, int]) -> PlacementPlan:
    """Pairs of the nodes named in `tflops` (FP16 TFLOP/s) whose memory holds the model's layers."""
    weights = model.num_layers * model.layer_bytes
    fit = sorted((n for n in tflops if memory_bytes.get(n, 0) > weights), key=lambda n: (tflops[n], n))
    if len(fit) < 2:
        raise ConfigError(f"Cronus needs two nodes that each hold all of {model.name} ({weights / 2**30:.1f} GiB of "
                          f"layers); {len(fit)} of {len(tflops)} do")
    pairs = [(fit[i], fit[-1 - i]) for i in range(len(fit) // 2)]
    replicas: list[Replica] = []
    for low, high in pairs:
        replicas += [Replica("ppi", (low,)), Replica("cpi", (high,))]
    placed = [n for pair in pairs for n in pair]
    left = sorted(set(fit) - set(placed))
    notes = (f"not paired: {', '.join(left)}",) if left else ()
    return PlacementPlan(cluster=cluster, model=model.name, num_layers=model.num_layers, method="cronus",
                         placements=tuple(NodePlacement(n, 0, model.num_layers) for n in placed),
                         status="heuristic", partial_inference=False, notes=notes, replicas=tuple(replicas))


class MeasuredDevice(Protocol):
    """What a node reports of its accelerator (`protocol.messages.HardwareProfile`'s fields read here)."""

    @property
    def device_type(self) -> str: ...
    @property
    def matmul_tflops(self) -> float: ...
    @property
    def memory_bytes(self) -> int: ...
    @property
    def mem_bandwidth_gbps(self) -> float: ...


def measured_device(profile: MeasuredDevice) -> DeviceSpec:
    """A device spec from a node's reported numbers (measured, or its emulated GPU's table numbers)."""
    return DeviceSpec(name=profile.device_type, kind=profile.device_type, count=1,
                      fp16_tflops=max(profile.matmul_tflops, 1e-6), memory_gb=profile.memory_bytes / 2**30,
                      mem_bandwidth_gbps=max(profile.mem_bandwidth_gbps, 1e-6), source="reported by the node")


def cronus_splitters(plan: PlacementPlan, model: ModelSpec, profiles: Mapping[str, MeasuredDevice],
                     max_batch_tokens: int = CHUNK) -> list[CronusBalancer]:
    """Each pair's balancer, its predictors (Eq. 2 and 3) fitted on the pair's nodes as they reported themselves
    at join time (§4.4 fits them on profiled runs; here on the cost model of the reported numbers)."""
    return device_splitters(plan, model, {n: measured_device(p) for n, p in profiles.items()}, max_batch_tokens)


def device_splitters(plan: PlacementPlan, model: ModelSpec, devices: Mapping[str, DeviceSpec],
                     max_batch_tokens: int = CHUNK) -> list[CronusBalancer]:
    """Each pair's balancer fitted on its two nodes' device specs (the simulator's nodes: their GPU tables)."""
    out = []
    for ppi, cpi in zip(plan.replicas[::2], plan.replicas[1::2], strict=True):
        low, high = devices.get(ppi.nodes[0]), devices.get(cpi.nodes[0])
        if low is None or high is None:
            raise ConfigError(f"no profile for the Cronus pair {ppi.nodes[0]}, {cpi.nodes[0]}")
        out.append(CronusBalancer(fit_partial_prefill(low, model),
                                  fit_chunked_iteration(high, model, max_batch_tokens)))
    return out
