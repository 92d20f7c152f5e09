"""Tensor-parallel stages as the simulator serves them: each stage of `tp` GPUs becomes one node of tp GPUs.

A ThunderServe plan (`Replica.tp` > 1) runs each pipeline stage on `tp` GPUs of one host and one type that all
hold the stage's layers. The simulator serves a stage as one node whose device is the `tp` GPUs together
("4xa6000": tp times the FLOP/s, memory bandwidth and memory, as a multi-GPU node of a cluster file is priced),
named after the stage's first GPU and keeping its host and region, so that every link rule (host, region,
pair and directed ones naming that GPU) gives the stage the links its first GPU has. The other GPUs of the
stage leave the cluster, with the rules that name them.

Tensor parallelism's all-reduces inside a stage (two ring all-reduces of the step's activations per layer over
the link between the stage's GPUs) are charged on top of the aggregate device's roofline, with the function
the planner prices them by (`planner.all_reduce`): `with_all_reduces` gives each stage's node a profile whose
per-layer step costs carry them. Before (issue 14) the simulator left them out, so a TP stage served faster
than the planner expected, prefill more than decode (its steps carry more tokens).
"""

from __future__ import annotations

from dataclasses import replace

from hetnode.errors import ConfigError
from hetnode.planner.all_reduce import tp_layer_s
from hetnode.planner.cluster import ClusterSpec, NodeSpec
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.profile import Curve, DeviceProfile, ProfileTable


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
                merged[first.name] = replace(first, device=stage_device(first, r.tp),
                                             memory_gb=first.memory_gb * r.tp)
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


def with_all_reduces(plan: PlacementPlan, cluster: ClusterSpec, profiles: ProfileTable,
                     model: ModelSpec) -> ProfileTable:
    """`profiles` (a table for the merged cluster) with an entry for every TP stage's node: its device's
    profile with each layer's all-reduces added to every prompt and decode step (module docstring), over the
    link between the stage's first two GPUs in `cluster` (the plan's own, before merging). The all-reduce is
    affine in the step's tokens, so adding it at the curves' points prices every step between them exactly."""
    extra: dict[str, DeviceProfile] = {}
    for r in plan.replicas:
        if r.tp <= 1:
            continue
        for s in range(0, len(r.nodes), r.tp):
            a, b = r.nodes[s], r.nodes[s + 1]
            first = cluster.node(a)
            link = cluster.link_or_none(a, b)
            bps, latency = ((link.bandwidth_mbps * 1e6 / 8, link.latency_ms / 1000) if link is not None
                            else (0.0, 0.0))
            base = profiles.for_node(a, stage_device(first, r.tp))

            def charged(curve: Curve, tp: int = r.tp, bps: float = bps, latency: float = latency) -> Curve:
                return tuple((x, y + tp_layer_s(tp, x, model.activation_bytes, bps, latency)) for x, y in curve)

            extra[a] = replace(base, name=a, prompt_curve=charged(base.prompt_curve),
                               decode_curve=charged(base.decode_curve),
                               source=f"{base.source}, with TP-{r.tp} all-reduces at {bps * 8 / 1e9:g} Gb/s")
    if not extra:
        return profiles
    return ProfileTable(model=profiles.model, profiles={**profiles.profiles, **extra},
                        source=f"{profiles.source}, TP stages' all-reduces charged")
