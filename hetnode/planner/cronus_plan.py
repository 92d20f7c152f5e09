"""Cronus's placement: nodes in pairs of a low-end and a high-end one, each holding the whole model (§4.2).

Nodes are ranked by FP16 FLOP/s (the prefill's measure, and the one §5.1 splits pipelines by); the weakest is
paired with the strongest, the next weakest with the next strongest, and so on, so that every pair has one
node to prefill beginnings (the PPI, the weaker) and one to finish prompts and decode (the CPI). The plan's
replicas list each pair as a "ppi" replica then a "cpi" one, which `coordinator/cronus_scheduler.py` routes. An
odd node out, or a node that cannot hold the whole model, holds nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

from hetnode.errors import ConfigError
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica


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
