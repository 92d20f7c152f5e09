"""A placement plan as text a person reads: one row per node, one per edge that carries flow, then the totals.

    node    device  region  layers    j   T_j tok/s  flow tok/s   util
    a100-0  a100    gcp     [0, 12)  12      9429.3      9429.3  100.0%
    ...

T_j, utilization and link capacities need the profile table and the model; without them those columns
show "-".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.flowgraph import link_capacity
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import SINK, SOURCE, PlacementPlan
from hetnode.planner.profile import ProfileTable


def node_flows(plan: PlacementPlan) -> dict[str, float]:
    """Tokens per second into each placed node."""
    through = {p.node: 0.0 for p in plan.placements}
    for (_, b), f in plan.flows.items():
        if b in through:
            through[b] += f
    return through


def carrying_edges(plan: PlacementPlan) -> list[tuple[tuple[str, str], float]]:
    """Edges whose flow is more than solver noise (a millionth of the max flow), sorted."""
    floor = 1e-6 * max(plan.max_flow, 1.0)
    return [(e, f) for e, f in sorted(plan.flows.items()) if f > floor]


def format_plan(plan: PlacementPlan, cluster: ClusterSpec, *, profiles: ProfileTable | None = None,
                model: ModelSpec | None = None) -> str:
    """The plan as a table of nodes, a table of edges with flow, and the max flow, bound, gap and solver facts."""
    through = node_flows(plan)
    known = {n.name: n for n in cluster.nodes}
    lines = [f"Plan for {plan.model} on {plan.cluster}: method {plan.method}, "
             f"partial inference {'on' if plan.partial_inference else 'off'}, {plan.num_layers} layers", ""]

    rows: list[list[str]] = []
    for p in sorted(plan.placements, key=lambda p: (p.first_layer, p.last_layer, p.node)):
        node = known.get(p.node)
        t_j = None
        if profiles is not None and node is not None:
            t_j = profiles.for_node(p.node, node.device).tokens_per_s(p.layers)
        flow = through[p.node]
        rows.append([p.node, node.device if node else "?", node.region if node else "?",
                     f"[{p.first_layer}, {p.last_layer})", str(p.layers), _num(t_j), _num(flow),
                     f"{flow / t_j:.1%}" if t_j else "-"])
    lines += _table(["node", "device", "region", "layers", "j", "T_j tok/s", "flow tok/s", "util"], rows,
                    right={4, 5, 6, 7})
    if plan.orchestration is not None:
        lines += ["", *format_orchestration(plan, cluster)]
    else:
        for r in plan.replicas:
            lines.append(f"{r.role} replica: {' -> '.join(r.nodes)}")
    placed = set(through)
    unused = [n.name for n in cluster.nodes if n.name not in placed]
    if unused:
        lines.append(f"holding no layers ({len(unused)}): {', '.join(unused)}")

    order = {p.node: (p.first_layer, p.last_layer) for p in plan.placements}

    def edge_key(edge: tuple[str, str]) -> tuple[int, tuple[int, int], tuple[int, int], str, str]:
        a, b = edge
        group = 0 if a == SOURCE else 2 if b == SINK else 1
        return group, order.get(a, (-1, -1)), order.get(b, (-1, -1)), a, b

    edges: list[list[str]] = []
    for (a, b), f in sorted(carrying_edges(plan), key=lambda ef: edge_key(ef[0])):
        cap = None
        if model is not None and all(e in known or e in (SOURCE, SINK) for e in (a, b)):
            cap = link_capacity(cluster, model, a, b)
        ra, rb = (cluster.coordinator_region if e in (SOURCE, SINK) else known[e].region if e in known else ""
                  for e in (a, b))
        cross = f"{ra} -> {rb}" if ra and rb and ra != rb else ""
        edges.append([a, b, _num(f), "unlimited" if cap is not None and math.isinf(cap) else _num(cap),
                      f"{f / cap:.1%}" if cap and math.isfinite(cap) else "-", cross])
    lines += ["", f"edges carrying flow ({len(edges)}):"]
    lines += _table(["from", "to", "flow tok/s", "capacity tok/s", "util", "crosses regions"], edges,
                    right={2, 3, 4})

    bound = plan.upper_bound
    gap = plan.gap
    lines += ["",
              f"max flow     {plan.max_flow:,.1f} tokens/s",
              f"upper bound  {f'{bound:,.1f} tokens/s' if math.isfinite(bound) else 'none'}",
              f"gap          {f'{gap:.2%}' if math.isfinite(gap) else '-'}",
              f"status       {plan.status or '-'}",
              f"solve time   {plan.solve_time_s:.2f} s"]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines) + "\n"


def format_orchestration(plan: PlacementPlan, cluster: ClusterSpec) -> list[str]:
    """A routed plan's replicas (role, parallel configuration, GPUs by stage) with X, then Y as a matrix."""
    assert plan.orchestration is not None
    ranges = plan.ranges()
    kinds = {n.name: n.device for n in cluster.nodes}
    names = {"prefill": 0, "decode": 0}
    rows: list[list[str]] = []
    x = plan.orchestration.prefill_share
    decode_names: list[str] = []
    for r in plan.replicas:
        label = f"{r.role[0].upper()}{names[r.role]}"
        share = f"{x[names[r.role]]:.3f}" if r.role == "prefill" else "-"
        names[r.role] += 1
        if r.role == "decode":
            decode_names.append(label)
        stages = [r.nodes[k:k + r.tp] for k in range(0, len(r.nodes), r.tp)]
        layers = " ".join(f"[{ranges[s[0]][0]},{ranges[s[0]][1]})" for s in stages)
        gpus = " | ".join("+".join(sorted({kinds.get(n, "?") for n in s})) + f"x{len(s)}" for s in stages)
        rows.append([label, r.role, f"({r.tp},{len(stages)})", gpus, layers, share])
    lines = _table(["replica", "role", "(tp,pp)", "stages (GPUs)", "layers", "X"], rows, right={5})
    lines += ["", "Y (rows: prefill replicas, columns: decode replicas):"]
    lines += _table(["", *decode_names],
                    [[f"P{i}", *(f"{v:.3f}" for v in row)] for i, row in enumerate(plan.orchestration.decode_share)],
                    right=set(range(1, len(decode_names) + 1)))
    lines += ["", f"estimated SLO attainment {plan.orchestration.slo_attainment:.1%}", "replica GPUs:"]
    lines += [f"  {row[0]}: {' '.join(r.nodes)}" for row, r in zip(rows, plan.replicas, strict=True)]
    return lines


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:,.1f}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], *, right: set[int]) -> list[str]:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths,
                                                                                               strict=True))).rstrip()

    return [line(header), *(line(r) for r in rows)]
