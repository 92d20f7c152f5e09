"""Pruning slow connections before the MILP (Helix §4.5, §6.8).

Each node keeps the `degree` connections to other nodes with the most capacity (activation tokens per
second over the link); a connection either end keeps stays, in both directions, so every node keeps at least
`degree` neighbours and the average degree is a little above it. Ties (a uniform 10 Gb/s cluster is all
ties) go to nodes in the same region, then to nodes of the same device type, then by name, so identical
nodes keep alike. The coordinator's source and sink edges are never pruned: they are not in the edge set
this returns, and the planner always gives every node both.

Helix prunes to an average degree of 12 on its 24- and 42-node clusters ("sufficient for LLM inference
systems... usually each node only communicates with a few other nodes"); `AUTO_DEGREE` and `AUTO_MIN_NODES`
make that the default for clusters of that size and leave smaller ones whole. The planner prunes the graph of
the §4.4 model only, whose size grows with the connections (as Helix's does); its other searches work on
neighbourhoods whose size does not, and pruning their graph only took placements away (placement.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.flowgraph import link_capacity
from hetnode.planner.heuristics import NodeInfo
from hetnode.planner.model import ModelSpec

AUTO_DEGREE = 12
AUTO_MIN_NODES = 20  # clusters with fewer nodes are not pruned by default

Edge = tuple[str, str]


def all_edges(infos: Sequence[NodeInfo]) -> list[Edge]:
    return [(a.name, b.name) for a in infos for b in infos if a.name != b.name]


def auto_degree(num_nodes: int) -> int | None:
    return AUTO_DEGREE if num_nodes >= AUTO_MIN_NODES else None


def prune_edges(cluster: ClusterSpec, model: ModelSpec, infos: Sequence[NodeInfo], degree: int | None) -> list[Edge]:
    """The directed node-to-node edges kept: each node's `degree` fastest links, both ways (None: all)."""
    if degree is None or degree >= len(infos) - 1:
        return all_edges(infos)
    if degree < 1:
        raise ValueError(f"prune degree must be >= 1, not {degree}")
    keep: set[frozenset[str]] = set()
    for a in infos:
        ranked = sorted(
            (b for b in infos if b.name != a.name),
            key=lambda b: (-min(link_capacity(cluster, model, a.name, b.name),
                                link_capacity(cluster, model, b.name, a.name)),
                           b.region != a.region, b.device != a.device, b.name))
        keep.update(frozenset((a.name, b.name)) for b in ranked[:degree])
    return [(a.name, b.name) for a in infos for b in infos
            if a.name != b.name and frozenset((a.name, b.name)) in keep]
