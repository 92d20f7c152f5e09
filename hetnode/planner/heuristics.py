"""The placement heuristics that Helix compares against (§6.2, §6.5, §6.6), and the warm starts of its MILP.

Each returns layer ranges {node: (first, last)}, half-open, over the nodes it uses; `flowgraph.evaluate`
turns them into a max flow. Every heuristic is a pure, deterministic function of its inputs (and its seed).

- Petals (Petals' Appendix D, as Helix's artifact re-implements it): nodes arrive one at a time and each
  takes as many layers as it can hold (its `max_layers`), at the contiguous block whose per-layer throughput
  so far is lowest (the sorted throughputs of the block compared lexicographically, so the block with the
  most uncovered layers wins; ties go to the earliest block). A node adds its throughput at that many layers
  to every layer of its block. Arrival order: the cluster file's order (join order, the default), fastest
  first ("capacity"), or a seeded shuffle ("random", what Helix's artifact does).
- Swarm (Helix §6.2): "the number of pipeline stages [is] the minimum that allows the weakest GPU to hold
  one stage with half its VRAM" -- the profiles' `max_layers` already keep half the memory for KV (Helix's
  `kv_share=0.5`), so stages = ceil(L / min max_layers); stages are as even as L allows. Nodes, fastest first
  (their throughput at the stage's size), join the stage with the least throughput so far.
- Separate pipelines, "sp" (Helix §6.2/§6.5): one pipeline per device type, over all that type's nodes, its
  layers split so that the stages' throughputs are as even as they can be (`balanced_split`; for identical
  nodes an even split). A type whose nodes cannot hold the whole model is left out. "sp+" (§6.5's SP+) also
  builds one mixed pipeline from the nodes left out, when together they hold the model.

Pipelines order their nodes region by region (the coordinator's region first) so that a pipeline crosses each
slow wide-area link once; a type with more nodes than the model has layers forms several pipelines.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec, NodeSpec
from hetnode.planner.model import ModelSpec
from hetnode.planner.profile import DeviceProfile, ProfileTable

Range = tuple[int, int]  # half-open [first, last)
Ranges = dict[str, Range]

PETALS_ORDERS = ("join", "capacity", "random")


@dataclass(frozen=True)
class NodeInfo:
    """What the heuristics (and the MILP) need to know about one node."""

    name: str
    device: str
    region: str
    max_layers: int  # k: min(profile.max_layers, L, entries in the throughput table)
    throughput: tuple[float, ...]  # T_1..T_k, tokens/s

    def t(self, layers: int) -> float:
        return self.throughput[layers - 1] if 1 <= layers <= self.max_layers else 0.0

    @property
    def best_layer_rate(self) -> float:
        """max_j j x T_j: the layer-tokens per second the node passes at its best layer count."""
        return max((j * t for j, t in enumerate(self.throughput, 1)), default=0.0)


def node_infos(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable) -> list[NodeInfo]:
    """Every node of the cluster that can hold at least one layer, in the cluster's order."""
    out = []
    for node in cluster.nodes:
        prof = profiles.for_node(node.name, node.device)
        info = _info(node, prof, model.num_layers)
        if info.max_layers >= 1:
            out.append(info)
    return out


def _info(node: NodeSpec, prof: DeviceProfile, num_layers: int) -> NodeInfo:
    k = min(prof.max_layers, num_layers)
    ts = tuple(prof.tokens_per_s(j) for j in range(1, k + 1))
    # A layer count with no throughput cannot be used, nor can any above it.
    for j, t in enumerate(ts, 1):
        if not t > 0:
            k = j - 1
            break
    return NodeInfo(node.name, node.device, node.region, k, ts[:k])


def layers_that_fit(infos: Sequence[NodeInfo]) -> int:
    return sum(i.max_layers for i in infos)


def check_fits(cluster: ClusterSpec, model: ModelSpec, infos: Sequence[NodeInfo]) -> None:
    fit = layers_that_fit(infos)
    if fit < model.num_layers:
        raise ConfigError(
            f"cluster {cluster.name} cannot hold {model.name}: its nodes hold {fit} layers "
            f"(with their KV share of memory kept free) and the model has {model.num_layers}")


# -- shared pieces ------------------------------------------------------------------------------------------------


def balanced_split(infos: Sequence[NodeInfo], num_layers: int) -> list[int] | None:
    """Layer counts j_i (each 1..k_i, summing to num_layers) that maximize min_i T^i_{j_i}.

    None when the nodes cannot hold the layers, or there are more nodes than layers. A node's count is the
    most layers it can take while staying at or above the best threshold; surplus layers are then taken
    back from the nodes with the most, so every stage stays at or above it."""
    if not infos or layers_that_fit(infos) < num_layers or len(infos) > num_layers:
        return None
    thresholds = sorted({t for i in infos for t in i.throughput})

    def counts(tau: float) -> list[int]:
        return [max((j for j in range(1, i.max_layers + 1) if i.t(j) >= tau), default=0) for i in infos]

    lo, hi = 0, len(thresholds) - 1  # thresholds[lo] is feasible (the smallest T of all)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        c = counts(thresholds[mid])
        if min(c) >= 1 and sum(c) >= num_layers:
            lo = mid
        else:
            hi = mid - 1
    c = counts(thresholds[lo])
    while sum(c) > num_layers:
        # Take a layer back where it raises the stage's throughput the most (ties: most layers, then order).
        best = max((n for n in range(len(c)) if c[n] > 1),
                   key=lambda n: (infos[n].t(c[n] - 1) - infos[n].t(c[n]), c[n], -n))
        c[best] -= 1
    return c


def region_order(cluster: ClusterSpec, infos: Sequence[NodeInfo]) -> dict[str, int]:
    """Regions ranked: the coordinator's first, then by compute, then by name."""
    compute: dict[str, float] = {}
    for i in infos:
        compute[i.region] = compute.get(i.region, 0.0) + i.best_layer_rate
    ranked = sorted(compute, key=lambda r: (r != cluster.coordinator_region, -compute[r], r))
    return {r: n for n, r in enumerate(ranked)}


def pipeline(infos: Sequence[NodeInfo], num_layers: int, rank: Mapping[str, int]) -> Ranges | None:
    """One pipeline over the nodes: balanced layer counts, region by region, faster nodes first."""
    counts = balanced_split(infos, num_layers)
    if counts is None:
        return None
    order = sorted(range(len(infos)), key=lambda n: (rank.get(infos[n].region, len(rank)),
                                                      -infos[n].t(counts[n]), n))
    out: Ranges = {}
    first = 0
    for n in order:
        out[infos[n].name] = (first, first + counts[n])
        first += counts[n]
    return out


# -- Petals -------------------------------------------------------------------------------------------------------


def petals_ranges(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable, *, order: str = "join",
                  seed: int = 0) -> Ranges:
    infos = node_infos(cluster, model, profiles)
    check_fits(cluster, model, infos)
    if order == "capacity":
        infos.sort(key=lambda i: -i.t(i.max_layers))
    elif order == "random":
        random.Random(seed).shuffle(infos)
    elif order != "join":
        raise ConfigError(f"unknown Petals order {order!r}; known: {', '.join(PETALS_ORDERS)}")
    num_layers = model.num_layers
    load = [0.0] * num_layers
    out: Ranges = {}
    for info in infos:
        k = info.max_layers
        start = min(range(num_layers - k + 1), key=lambda s: (sorted(load[s:s + k]), s))
        out[info.name] = (start, start + k)
        for layer in range(start, start + k):
            load[layer] += info.t(k)
    if min(load) <= 0:  # cannot happen while the nodes hold the model: uncovered layers are chosen first
        raise ConfigError(f"Petals' placement leaves layer {load.index(min(load))} of {model.name} uncovered")
    return out


# -- Swarm --------------------------------------------------------------------------------------------------------


def swarm_stage_sizes(infos: Sequence[NodeInfo], num_layers: int) -> list[int]:
    weakest = min(i.max_layers for i in infos)
    stages = math.ceil(num_layers / weakest)
    base, extra = divmod(num_layers, stages)
    return [base + 1 if s < extra else base for s in range(stages)]


def swarm_ranges(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable) -> Ranges:
    infos = node_infos(cluster, model, profiles)
    check_fits(cluster, model, infos)
    sizes = swarm_stage_sizes(infos, model.num_layers)
    if len(infos) < len(sizes):
        raise ConfigError(f"Swarm's placement needs {len(sizes)} stages (the weakest node holds "
                          f"{min(i.max_layers for i in infos)} layers) but cluster {cluster.name} has "
                          f"{len(infos)} nodes")
    firsts = [sum(sizes[:s]) for s in range(len(sizes))]
    rate = [0.0] * len(sizes)
    out: Ranges = {}
    for info in sorted(infos, key=lambda i: (-i.t(sizes[0]), i.name)):
        # Empty stages first, then the stage with the least throughput so far.
        stage = min(range(len(sizes)), key=lambda s: (rate[s] > 0, rate[s], s))
        out[info.name] = (firsts[stage], firsts[stage] + sizes[stage])
        rate[stage] += info.t(sizes[stage])
    return out


# -- separate pipelines -------------------------------------------------------------------------------------------


def _type_pipelines(infos: Sequence[NodeInfo], num_layers: int, rank: Mapping[str, int]) -> list[Ranges] | None:
    """All of one group's nodes in as few pipelines as possible (several only when nodes outnumber layers)."""
    if layers_that_fit(infos) < num_layers:
        return None
    count = max(1, math.ceil(len(infos) / num_layers))
    # Deal the nodes out region by region so each pipeline stays as local as the group allows.
    ordered = sorted(infos, key=lambda i: (rank.get(i.region, len(rank)), -i.best_layer_rate, i.name))
    groups = [ordered[p::count] for p in range(count)]
    out: list[Ranges] = []
    for group in groups:
        ranges = pipeline(group, num_layers, rank)
        if ranges is None:
            return None
        out.append(ranges)
    return out


def sp_pipelines(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable, *,
                 plus: bool = False) -> list[Ranges]:
    """The separate pipelines, each its own ranges: requests must stay inside one (`sp_connections`)."""
    infos = node_infos(cluster, model, profiles)
    check_fits(cluster, model, infos)
    rank = region_order(cluster, infos)
    by_type: dict[str, list[NodeInfo]] = {}
    for info in infos:
        by_type.setdefault(info.device, []).append(info)
    out: list[Ranges] = []
    left: list[NodeInfo] = []
    for device in sorted(by_type):
        pipelines = _type_pipelines(by_type[device], model.num_layers, rank)
        if pipelines is None:
            left.extend(by_type[device])
        else:
            out.extend(pipelines)
    if plus and left:
        mixed = pipeline(left, model.num_layers, rank)
        if mixed is not None:
            out.append(mixed)
    if not out:
        raise ConfigError(f"separate pipelines: no device type of cluster {cluster.name} holds {model.name} "
                          f"alone{'' if plus else ' (sp+ also builds a mixed pipeline from the rest)'}")
    return out


def sp_ranges(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable, *, plus: bool = False) -> Ranges:
    return {n: r for ranges in sp_pipelines(cluster, model, profiles, plus=plus) for n, r in ranges.items()}


def sp_connections(pipelines: Sequence[Ranges]) -> list[tuple[str, str]]:
    """The connections inside each pipeline. With partial inference the pipelines would connect wherever one's
    range meets another's, and flow over those moves requests from one replica into another: separate
    pipelines keep each request in one."""
    return [(a, b) for ranges in pipelines for a in ranges for b in ranges if a != b]


HEURISTICS: dict[str, Callable[[ClusterSpec, ModelSpec, ProfileTable], Ranges]] = {
    "petals": petals_ranges,
    "swarm": swarm_ranges,
    "sp": sp_ranges,
    "sp+": lambda c, m, p: sp_ranges(c, m, p, plus=True),
}
