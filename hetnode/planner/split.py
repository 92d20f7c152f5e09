"""The first phase-split plan (issue 11's `--placement split`): which nodes prefill, which decode, and the replicas.

Prefill is compute-bound and decode is memory-bound (Splitwise §III), so a node's *affinity* for prefill is the
ratio of its prefill rate to its decode rate, both in layer-tokens per second from its profile: the prompt curve
at the workload's prompt length, and the decode curve at the batch its memory would hold alone. Nodes are ranked
by affinity (the strongest compute per byte of bandwidth first) and the plan cuts that ranking where the two
pools sustain the most requests per second together: the prefill pool needs `input_len` tokens of prefill per
request, the decode pool `output_len` tokens of decode, so the cut maximises
min(prefill rate / input_len, decode rate / output_len). On identical nodes the ranking is a tie and the cut
still follows the workload's prompt/decode ratio.

Each pool is then grouped into replicas, pipelines that hold the whole model, as many as the pool's memory
allows: a node that holds every layer is a replica by itself, the others are chained region by region, largest
first, until their memory holds the model (laid out by the heuristics' balanced `pipeline`). Requests pick one
prefill and one decode replica (`coordinator/split_scheduler.py`). Pure: no I/O, no clock but the solve time.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Mapping, Sequence

from hetnode.errors import ConfigError
from hetnode.planner import flowgraph
from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.heuristics import Linked, NodeInfo, node_infos, pipeline, region_order
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.planner.profile import DeviceProfile, ProfileTable, Workload, interpolate, kv_tokens

Range = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Rates:
    """A node's prefill and decode rates in layer-tokens per second (a pipeline of j layers: divide by j)."""

    prefill: float
    decode: float

    @property
    def affinity(self) -> float:
        return self.prefill / self.decode if self.decode > 0 else float("inf")


def node_rates(profile: DeviceProfile, model: ModelSpec, workload: Workload, layers: int) -> Rates:
    """Prefill: a whole prompt of the workload's length per step. Decode: the batch that the node's KV holds
    beside `layers` layers (at most the workload's max batch), with the context cost of half the output."""
    prompt_s = interpolate(profile.prompt_curve, workload.input_len)
    context = workload.input_len + workload.output_len // 2
    batch = max(1.0, min(float(workload.max_batch),
                         kv_tokens(profile.memory_bytes, model, max(1, layers)) / max(1.0, float(context))))
    decode_s = interpolate(profile.decode_curve, batch) + profile.decode_context_s * context * batch
    return Rates(prefill=workload.input_len / prompt_s if prompt_s > 0 else 0.0,
                 decode=batch / decode_s if decode_s > 0 else 0.0)


def split_placement(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable, *,
                    workload: Workload | None = None) -> PlacementPlan:
    """The phase-split plan over `cluster`: roles by affinity, the cut by the workload, replicas per role.

    Raises ConfigError when the cluster cannot be split: fewer than two nodes, or no cut leaves both pools
    enough memory for the whole model."""
    began = time.perf_counter()
    workload = workload or Workload()
    infos = node_infos(cluster, model, profiles)
    if len(infos) < 2:
        raise ConfigError(f"a phase-split plan needs at least two nodes that hold layers; cluster {cluster.name} "
                          f"has {len(infos)}")
    num_layers = model.num_layers
    rates = {i.name: node_rates(profiles.for_node(i.name, i.device), model, workload, min(i.max_layers, num_layers))
             for i in infos}
    ranked = sorted(infos, key=lambda i: (-rates[i.name].affinity, i.name))
    best: tuple[float, int] | None = None
    for k in range(1, len(ranked)):
        prefill, decode = ranked[:k], ranked[k:]
        if sum(i.max_layers for i in prefill) < num_layers or sum(i.max_layers for i in decode) < num_layers:
            continue
        served = min(sum(rates[i.name].prefill for i in prefill) / (workload.input_len * num_layers),
                     sum(rates[i.name].decode for i in decode) / (max(1, workload.output_len) * num_layers))
        if best is None or served > best[0]:
            best = (served, k)
    if best is None:
        raise ConfigError(f"cluster {cluster.name} cannot be split into a prefill and a decode pool that each hold "
                          f"{model.name} ({num_layers} layers) in memory")
    served, k = best
    rank = region_order(cluster, infos)

    def linked(a: str, b: str) -> bool:
        return cluster.has_link(a, b)

    replicas: list[Replica] = []
    ranges: dict[str, Range] = {}
    for role, pool in (("prefill", ranked[:k]), ("decode", ranked[k:])):
        groups = replica_groups(pool, num_layers, rank, linked)
        if not groups:
            raise ConfigError(f"the {role} pool of cluster {cluster.name} ({', '.join(i.name for i in pool)}) "
                              f"forms no pipeline over {model.name}: its nodes lack the links to chain them")
        for group in groups:
            order = sorted(group, key=lambda n: group[n][0])
            replicas.append(Replica(role=role, nodes=tuple(order)))
            ranges.update(group)
    connections = tuple((a, b) for r in replicas for a, b in itertools.pairwise(r.nodes))
    prefill_rate = sum(rates[i.name].prefill for i in ranked[:k])
    notes = (f"{k} of {len(ranked)} nodes prefill (affinity = prefill / decode rate, highest first); "
             f"the pools sustain {served:.2f} requests/s of {workload.input_len} in, {workload.output_len} out "
             f"(prefill pool {prefill_rate / num_layers:.0f} prompt tokens/s)",)
    # The flow over the replicas' own connections, as the other methods report it (each replica a pipeline).
    flow = flowgraph.evaluate(cluster, model, profiles, ranges, partial=False, allowed=list(connections))
    return PlacementPlan(
        cluster=cluster.name, model=model.name, num_layers=num_layers, method="split",
        placements=tuple(NodePlacement(n, *ranges[n]) for n in sorted(ranges)), flows=dict(flow.flows),
        max_flow=flow.value, status="heuristic",
        solve_time_s=time.perf_counter() - began, partial_inference=False, notes=notes,
        connections=connections, replicas=tuple(replicas))


def replica_groups(pool: Sequence[NodeInfo], num_layers: int, rank: Mapping[str, int],
                   linked: Linked | None = None) -> list[dict[str, Range]]:
    """As many pipelines over the whole model as the pool's memory allows; nodes left over join the last
    pipeline of their region when it can take them, and stay idle otherwise."""
    ordered = sorted(pool, key=lambda i: (rank.get(i.region, len(rank)), -i.max_layers, -i.best_layer_rate, i.name))
    groups: list[dict[str, Range]] = []
    members: list[list[NodeInfo]] = []
    current: list[NodeInfo] = []
    for info in ordered:
        if info.max_layers >= num_layers:
            ranges = pipeline([info], num_layers, rank, linked)
            if ranges is not None:
                groups.append(ranges)
                members.append([info])
                continue
        current.append(info)
        if sum(i.max_layers for i in current) >= num_layers:
            ranges = pipeline(current, num_layers, rank, linked)
            if ranges is not None:
                groups.append(ranges)
                members.append(current)
                current = []
    for info in current:  # too few to make a pipeline of their own
        for g in range(len(groups) - 1, -1, -1):
            if members[g][0].region != info.region:
                continue
            ranges = pipeline([*members[g], info], num_layers, rank, linked)
            if ranges is not None:
                groups[g] = ranges
                members[g] = [*members[g], info]
                break
    return groups
