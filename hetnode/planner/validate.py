"""Check a placement plan against its cluster, model and profile table, independently of how it was made.

`validate_plan` returns every problem it finds as a sentence (an empty list means the plan is valid):

- every node in the plan is a node of the cluster, placed once, and the plan is for the model's layer count;
- every layer range lies within [0, L) and holds at most the node's max_layers; every layer is held somewhere;
- flows run only on edges the placement makes valid (`flowgraph.connects`, with or without partial inference
  as the plan says) and the cluster has a link for (a missing or one-way link is named as such), are not
  negative, and are conserved at every node;
- a node's flow is at most its throughput T_j and an edge's flow at most its link capacity, within a tolerance;
- the plan's max_flow is what leaves SOURCE, and it equals the max flow of the placement's graph computed here
  with a second algorithm (scipy's Dinic on integer capacities; flowgraph uses networkx's Edmonds-Karp), to
  within 0.5%.

A plan solved over a pruned graph (Helix §4.5) reaches the max flow of that graph; pass its edges as
`allowed` to compare with it rather than with the full graph.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import maximum_flow

from hetnode.planner.cluster import COORDINATOR, ClusterSpec
from hetnode.planner.flowgraph import connects, link_capacity
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import SINK, SOURCE, PlacementPlan
from hetnode.planner.profile import ProfileTable

MAX_FLOW_TOLERANCE = 0.005  # the plan's max_flow and the independent one agree within this share
_INT_MAX = 2**31 - 1  # scipy's maximum_flow takes int32 capacities


def validate_plan(plan: PlacementPlan, cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable, *,
                  rel_tol: float = 1e-5, abs_tol: float = 1e-3,
                  allowed: Iterable[tuple[str, str]] | None = None) -> list[str]:
    """Every way in which `plan` is not a valid plan for this cluster, model and profile table.

    rel_tol and abs_tol (tokens/s) bound how far a flow may exceed a capacity or break conservation: a MILP
    solver's flows are feasible only to its tolerances. A plan that names its connections (separate pipelines)
    is checked over those unless `allowed` says otherwise."""
    problems: list[str] = []
    if allowed is None and plan.connections is not None:
        allowed = plan.connections
    names = {n.name for n in cluster.nodes}

    def over(value: float, limit: float) -> bool:
        return value > limit + abs_tol + rel_tol * abs(limit)

    if plan.num_layers != model.num_layers:
        problems.append(f"the plan is for {plan.num_layers} layers; {model.name} has {model.num_layers}")
    L = model.num_layers

    # -- placements ---------------------------------------------------------------------------------------
    ranges: dict[str, tuple[int, int]] = {}
    capacity: dict[str, float] = {}
    tp = {n: r.tp for r in plan.replicas for n in r.nodes}
    for p in plan.placements:
        if p.node not in names:
            problems.append(f"node {p.node!r} is not in cluster {cluster.name}")
            continue
        if p.node in ranges:
            problems.append(f"node {p.node!r} is placed twice")
            continue
        if not 0 <= p.first_layer < p.last_layer <= L:
            problems.append(f"node {p.node}: layers [{p.first_layer}, {p.last_layer}) are not within [0, {L})")
            continue
        prof = profiles.for_node(p.node, cluster.node(p.node).device)
        # A GPU in a tensor parallel stage of d holds 1/d of each of its layers.
        if -(-p.layers // tp.get(p.node, 1)) > prof.max_layers:
            problems.append(f"node {p.node}: holds {p.layers} layers, more than its max_layers {prof.max_layers}")
        ranges[p.node] = (p.first_layer, p.last_layer)
        capacity[p.node] = prof.tokens_per_s(p.layers)
    covered = np.zeros(L, dtype=bool)
    for first, last in ranges.values():
        covered[first:last] = True
    gaps = _runs(np.flatnonzero(~covered).tolist())
    if gaps:
        problems.append(f"layers {', '.join(gaps)} are held by no node")

    if plan.orchestration is not None:
        # Routed by its orchestration, not by a max flow: the replicas and the shares are what to check.
        return problems + _orchestration_problems(plan, ranges, L)

    # -- flows --------------------------------------------------------------------------------------------
    allow = None if allowed is None else set(allowed)
    inflow = dict.fromkeys(ranges, 0.0)
    outflow = dict.fromkeys(ranges, 0.0)
    source_out = 0.0
    sink_in = 0.0
    for (a, b), f in sorted(plan.flows.items()):
        edge = f"edge {a} -> {b}"
        if not math.isfinite(f) or f < -abs_tol:
            problems.append(f"{edge}: flow {f} is not a finite non-negative number")
            continue
        unknown = [e for e in (a, b) if e not in ranges and e not in (SOURCE, SINK)]
        if unknown:
            what = "not in the cluster" if unknown[0] not in names else "a node that holds no layers"
            problems.append(f"{edge}: {unknown[0]!r} is {what}")
            continue
        if not _valid_edge(a, b, ranges, L, plan.partial_inference):
            if f > abs_tol:
                problems.append(f"{edge}: carries {f:.6g} tokens/s but is not a valid connection "
                                f"({_describe(a, b, ranges)})")
            continue
        if allow is not None and SOURCE not in (a, b) and SINK not in (a, b) and (a, b) not in allow and f > abs_tol:
            problems.append(f"{edge}: carries {f:.6g} tokens/s on a pruned connection")
        cap = link_capacity(cluster, model, a, b)
        if cap <= 0:
            if f > abs_tol:
                problems.append(f"{edge}: carries {f:.6g} tokens/s but the cluster has no link from "
                                f"{_endpoint(a)} to {_endpoint(b)}")
            continue
        if over(f, cap):
            problems.append(f"{edge}: flow {f:.6g} is over the link capacity {cap:.6g} tokens/s")
        if a == SOURCE:
            source_out += f
        else:
            outflow[a] += f
        if b == SINK:
            sink_in += f
        else:
            inflow[b] += f
    for n in ranges:
        if abs(inflow[n] - outflow[n]) > abs_tol + rel_tol * max(inflow[n], outflow[n]):
            problems.append(f"node {n}: flow is not conserved ({inflow[n]:.6g} in, {outflow[n]:.6g} out)")
        if over(inflow[n], capacity[n]):
            problems.append(f"node {n}: flow {inflow[n]:.6g} is over its throughput T_{ranges[n][1] - ranges[n][0]}"
                            f" = {capacity[n]:.6g} tokens/s")
    if abs(source_out - plan.max_flow) > abs_tol + rel_tol * plan.max_flow:
        problems.append(f"max_flow {plan.max_flow:.6g} is not the flow out of the source ({source_out:.6g})")
    if abs(source_out - sink_in) > abs_tol + rel_tol * source_out:
        problems.append(f"the flow out of the source ({source_out:.6g}) is not the flow into the sink "
                        f"({sink_in:.6g})")

    # -- the max flow, by a second algorithm ----------------------------------------------------------------
    if ranges:
        independent = independent_max_flow(cluster, model, profiles, ranges, partial=plan.partial_inference,
                                           allowed=allow)
        scale = max(independent, plan.max_flow)
        if scale > 0 and abs(independent - plan.max_flow) > MAX_FLOW_TOLERANCE * scale:
            problems.append(f"max_flow {plan.max_flow:.6g} differs from the max flow of the placement's graph, "
                            f"{independent:.6g} tokens/s (scipy, Dinic), by more than "
                            f"{MAX_FLOW_TOLERANCE:.1%}")
    return problems


def _orchestration_problems(plan: PlacementPlan, ranges: Mapping[str, tuple[int, int]], num_layers: int,
                            tol: float = 1e-6) -> list[str]:
    """A routed phase-split plan: each replica covers every layer once, stage by stage (runs of tp nodes on
    one range), and X and Y are distributions over the plan's prefill and decode replicas."""
    problems: list[str] = []
    assert plan.orchestration is not None
    for k, r in enumerate(plan.replicas):
        if r.tp < 1 or len(r.nodes) % r.tp:
            problems.append(f"replica {k}: {len(r.nodes)} nodes do not form stages of tp {r.tp}")
            continue
        at = 0
        for s in range(0, len(r.nodes), r.tp):
            stage = {ranges.get(n) for n in r.nodes[s:s + r.tp]}
            if len(stage) != 1 or None in stage:
                problems.append(f"replica {k}: nodes {', '.join(r.nodes[s:s + r.tp])} do not hold one range")
                break
            (first, last), = stage  # type: ignore[misc]
            if first != at:
                problems.append(f"replica {k}: a stage starts at layer {first}, not {at}")
                break
            at = last
        else:
            if at != num_layers:
                problems.append(f"replica {k}: its stages end at layer {at}, not {num_layers}")
    prefill = sum(r.role == "prefill" for r in plan.replicas)
    decode = sum(r.role == "decode" for r in plan.replicas)
    x, y = plan.orchestration.prefill_share, plan.orchestration.decode_share
    if len(x) != prefill or len(y) != prefill or any(len(row) != decode for row in y):
        problems.append(f"the orchestration is not {prefill} prefill by {decode} decode replicas")
        return problems
    if any(v < -tol for v in x) or abs(sum(x) - 1) > tol:
        problems.append("the prefill shares X are not a distribution")
    if any(any(v < -tol for v in row) or abs(sum(row) - 1) > tol for row in y):
        problems.append("a row of the decode shares Y is not a distribution")
    return problems


def independent_max_flow(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable,
                         ranges: Mapping[str, tuple[int, int]], *, partial: bool = True,
                         allowed: Iterable[tuple[str, str]] | None = None) -> float:
    """The max flow of a placement's graph by scipy's Dinic, on capacities scaled to int32.

    The graph is built here from the same definitions (node throughput T_j on each node's in->out edge, link
    capacities between nodes that `connects`), not by flowgraph.build_graph. Infinite capacities become the
    sum of the node throughputs, which no flow can exceed; all capacities are then scaled so that this sum
    is 2**31 - 1 and rounded down, which loses at most one unit per edge of a cut (a relative error near
    edges / 2**31)."""
    allow = None if allowed is None else set(allowed)
    nodes = sorted(ranges)
    index = {n: 2 + 2 * i for i, n in enumerate(nodes)}  # n:in = index, n:out = index + 1; SOURCE 0, SINK 1
    caps: dict[tuple[int, int], float] = {}
    node_total = 0.0
    for n in nodes:
        first, last = ranges[n]
        t = profiles.for_node(n, cluster.node(n).device).tokens_per_s(last - first)
        caps[(index[n], index[n] + 1)] = t
        node_total += t
    if node_total <= 0:
        return 0.0
    L = model.num_layers
    for n in nodes:
        first, last = ranges[n]
        # A missing link is a capacity of 0 here: the same as no edge.
        if first == 0 and cluster.has_link(COORDINATOR, n):
            caps[(0, index[n])] = link_capacity(cluster, model, SOURCE, n)
        if last == L and cluster.has_link(n, COORDINATOR):
            caps[(index[n] + 1, 1)] = link_capacity(cluster, model, n, SINK)
        for m in nodes:
            if m != n and connects(ranges[n], ranges[m], partial=partial) and (allow is None or (n, m) in allow) \
                    and cluster.has_link(n, m):
                caps[(index[n] + 1, index[m])] = link_capacity(cluster, model, n, m)
    unit = _INT_MAX / node_total
    rows, cols, data = [], [], []
    for (u, v), c in caps.items():
        rows.append(u)
        cols.append(v)
        data.append(int(min(c, node_total) * unit))
    size = 2 + 2 * len(nodes)
    graph = csr_matrix((np.array(data, dtype=np.int32), (np.array(rows), np.array(cols))), shape=(size, size))
    result = maximum_flow(graph, 0, 1, method="dinic")
    return float(result.flow_value) / unit


def _endpoint(name: str) -> str:
    return "the coordinator" if name in (SOURCE, SINK) else name


def _valid_edge(a: str, b: str, ranges: Mapping[str, tuple[int, int]], num_layers: int, partial: bool) -> bool:
    if a == SOURCE:
        return b != SINK and b in ranges and ranges[b][0] == 0
    if b == SINK:
        return a in ranges and ranges[a][1] == num_layers
    if a in (SINK, b) or b == SOURCE:
        return False
    return connects(ranges[a], ranges[b], partial=partial)


def _describe(a: str, b: str, ranges: Mapping[str, tuple[int, int]]) -> str:
    def show(n: str) -> str:
        return n if n in (SOURCE, SINK) else f"{n} [{ranges[n][0]}, {ranges[n][1]})"

    return f"{show(a)} to {show(b)}"


def _runs(layers: list[int]) -> list[str]:
    """[3, 4, 5, 9] -> ["[3, 6)", "[9, 10)"]."""
    out: list[str] = []
    i = 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        out.append(f"[{layers[i]}, {layers[j] + 1})")
        i = j + 1
    return out
