"""Tensor-parallel stages as the simulator serves them: each stage of `tp` GPUs becomes one node of tp GPUs.

A ThunderServe plan (`Replica.tp` > 1) runs each pipeline stage on `tp` GPUs of one host and one type that all
hold the stage's layers. The simulator serves a stage as one node whose device is the `tp` GPUs together
("4xa6000": tp times the FLOP/s, memory bandwidth and memory, as a multi-GPU node of a cluster file is priced),
named after the stage's first GPU and keeping its host and region, so that every link rule (host, region,
pair and directed ones naming that GPU) gives the stage the links its first GPU has. The other GPUs of the
stage leave the cluster, with the rules that name them.

Tensor parallelism's all-reduces inside a stage (two ring all-reduces of the step's activations per layer) are
charged where every multi-GPU node's are: by its roofline profile (`profile.roofline_profile`), over the node's
`gpu_link`, which the merged node takes from the plan's cluster (the link between the stage's first two GPUs),
with the function the planner prices them by (`planner.all_reduce`). So a TP stage costs in the simulator what
the planner prices, and pays once: a node of a cluster file with several GPUs ("4xa6000") pays the same charge
over PCIe, and a measured profile of the merged device (Helix's "2xl4") pays none beyond what it measured.
Before (issue 14) the simulator left them out, so a TP stage served faster than the planner expected, prefill
more than decode (its steps carry more tokens).
"""

from __future__ import annotations

from dataclasses import replace

from hetnode.errors import ConfigError
from hetnode.planner.cluster import PCIE_LINK, ClusterSpec, LinkSpec, NodeSpec
from hetnode.planner.plan import PlacementPlan


def merge_tensor_parallel(plan: PlacementPlan, cluster: ClusterSpec) -> tuple[PlacementPlan, ClusterSpec]:
    """The plan with every TP stage one node (tp 1) and the cluster with those nodes (module docstring); a plan
    without TP comes back as it is."""
    if not any(r.tp > 1 for r in plan.replicas):
        return plan, cluster
    ranges = plan.ranges()
    merged: dict[str, NodeSpec] = {}
    gone: set[str] = set()
    replicas = []
    for k, r in enumerate(plan.replicas):
        if r.tp < 1 or len(r.nodes) % r.tp:
            raise ConfigError(f"plan replica {k}: tp {r.tp} does not divide its {len(r.nodes)} nodes")
        stages = [r.nodes[s:s + r.tp] for s in range(0, len(r.nodes), r.tp)]
        for cell in stages:
            specs = [cluster.node(n) for n in cell]
            kinds = {(s.device_spec.kind, s.device_spec.count, s.machine, s.region) for s in specs}
            if len(kinds) != 1 or len({ranges.get(n) for n in cell}) != 1:
                raise ConfigError(f"plan replica {k}: stage {', '.join(cell)} is not GPUs of one type and host "
                                  "holding one layer range")
            if r.tp > 1:
                first = specs[0]
                link = cluster.link_or_none(cell[0], cell[1])
                if link is None:
                    raise ConfigError(f"plan replica {k}: no link between {cell[0]} and {cell[1]} for the stage's "
                                      "all-reduces")
                if first.device_spec.count > 1:  # the ring also crosses each node's own link: the slower
                    inner = first.gpu_link or PCIE_LINK
                    link = LinkSpec(bandwidth_mbps=min(link.bandwidth_mbps, inner.bandwidth_mbps),
                                    latency_ms=max(link.latency_ms, inner.latency_ms))
                merged[first.name] = replace(first, device=stage_device(first, r.tp),
                                             memory_gb=first.memory_gb * r.tp, gpu_link=link)
                gone |= set(cell[1:])
        replicas.append(replace(r, nodes=tuple(cell[0] for cell in stages), tp=1))
    nodes = tuple(merged.get(n.name, n) for n in cluster.nodes if n.name not in gone)
    out = replace(cluster, nodes=nodes,
                  pair_links={k: v for k, v in cluster.pair_links.items() if not k & gone},
                  directed_links={k: v for k, v in cluster.directed_links.items() if not set(k) & gone})
    placements = tuple(p for p in plan.placements if p.node not in gone)
    return replace(plan, replicas=tuple(replicas), placements=placements), out


def stage_device(first: NodeSpec, tp: int) -> str:
    """The device of a stage of `tp` GPUs like `first` ("2xa6000")."""
    device = first.device_spec
    return f"{tp * device.count}x{device.kind}"


def stage_cells(plan: PlacementPlan) -> dict[str, tuple[str, ...]]:
    """The GPUs each node of the merged plan stands for, by its name (the stage's first GPU): a stage's `tp` GPUs,
    or the node alone where it is no tensor-parallel stage."""
    cells: dict[str, tuple[str, ...]] = {p.node: (p.node,) for p in plan.placements}
    for r in plan.replicas:
        for s in range(0, len(r.nodes), max(1, r.tp)):
            cell = r.nodes[s:s + max(1, r.tp)]
            cells[cell[0]] = tuple(cell)
            for gpu in cell[1:]:
                cells.pop(gpu, None)
    return cells
