"""The simple placement of the inference-path issue: one pipeline through the nodes, with contiguous layer
ranges proportional to each node's capacity (the Helix planner replaces it).

Capacity is a node's memory bandwidth: serving is dominated by decode, which reads every weight once per step,
so a node's decode throughput for j layers scales with bandwidth / j. Nodes are ordered region by region
(the coordinator's region first) so that the pipeline crosses each wide-area link once, and faster nodes
come first within a region. Largest-remainder rounding; every chosen node gets at least one layer and at most
what fits in its memory after the KV reserve.
"""

from __future__ import annotations

from dataclasses import dataclass

from hetnode.errors import ConfigError


@dataclass(frozen=True)
class Candidate:
    node: str
    region: str
    capacity: float  # relative throughput (memory bandwidth, GB/s)
    memory_bytes: int


@dataclass(frozen=True)
class Placement:
    node: str
    first_layer: int
    last_layer: int  # exclusive


def proportional_layout(candidates: list[Candidate], num_layers: int, layer_bytes: int, *,
                        home_region: str = "", kv_reserve: float = 0.3) -> list[Placement]:
    if num_layers < 1:
        raise ConfigError("a model needs at least one layer")
    if not candidates:
        raise ConfigError("no nodes to place layers on")
    regions: dict[str, float] = {}
    for c in candidates:
        regions[c.region] = regions.get(c.region, 0.0) + c.capacity
    region_order = sorted(regions, key=lambda r: (r != home_region, -regions[r], r))
    ordered = sorted(candidates, key=lambda c: (region_order.index(c.region), -c.capacity, c.node))
    # More nodes than layers: the slowest are left out (each stage needs at least one layer).
    chosen = sorted(ordered, key=lambda c: (-c.capacity, c.node))[:num_layers]
    ordered = [c for c in ordered if c in chosen]
    limit = {c.node: max(0, int(c.memory_bytes * (1 - kv_reserve)) // max(layer_bytes, 1)) for c in ordered}
    if sum(limit.values()) < num_layers:
        raise ConfigError(f"the nodes' memory holds {sum(limit.values())} of {num_layers} layers")
    total = sum(c.capacity for c in ordered) or 1.0
    share = {c.node: num_layers * c.capacity / total for c in ordered}
    counts = {n: max(1, min(limit[n], int(s))) for n, s in share.items()}
    # Largest remainder first, within memory limits, until every layer is placed.
    while sum(counts.values()) < num_layers:
        room = [n for n in counts if counts[n] < limit[n]]
        best = max(room, key=lambda n: (share[n] - counts[n], n))
        counts[best] += 1
    while sum(counts.values()) > num_layers:
        over = [n for n in counts if counts[n] > 1]
        worst = min(over, key=lambda n: (share[n] - counts[n], n))
        counts[worst] -= 1
    out, first = [], 0
    for c in ordered:
        n = counts[c.node]
        out.append(Placement(c.node, first, first + n))
        first += n
    return out
