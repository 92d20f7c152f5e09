"""Tensor-parallel stages as the simulator serves them: each stage of `tp` GPUs becomes one node of tp GPUs.

A ThunderServe plan (`Replica.tp` > 1) runs each pipeline stage on `tp` GPUs of one host and one type that all
hold the stage's layers. The simulator serves a stage as one node whose device is the `tp` GPUs together
("4xa6000": tp times the FLOP/s, memory bandwidth and memory, as a multi-GPU node of a cluster file is priced),
named after the stage's first GPU and keeping its host and region, so that every link rule (host, region,
pair and directed ones naming that GPU) gives the stage the links its first GPU has. The other GPUs of the
stage leave the cluster, with the rules that name them. What this leaves out: tensor parallelism's
all-reduces inside the stage (the planner prices them, `thunderserve.parallel`; the aggregate device does not,
as for any multi-GPU node), so a TP stage serves somewhat faster here than the planner expects.
"""

from __future__ import annotations

from dataclasses import replace

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec, NodeSpec
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
                device = first.device_spec
                merged[first.name] = replace(first, device=f"{r.tp * device.count}x{device.kind}",
                                             memory_gb=first.memory_gb * r.tp)
                gone |= set(cell[1:])
        replicas.append(replace(r, nodes=tuple(cell[0] for cell in stages), tp=1))
    nodes = tuple(merged.get(n.name, n) for n in cluster.nodes if n.name not in gone)
    out = replace(cluster, nodes=nodes,
                  pair_links={k: v for k, v in cluster.pair_links.items() if not k & gone},
                  directed_links={k: v for k, v in cluster.directed_links.items() if not set(k) & gone})
    placements = tuple(p for p in plan.placements if p.node not in gone)
    return replace(plan, replicas=tuple(replicas), placements=placements), out
