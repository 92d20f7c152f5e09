"""A max flow that spreads over every node that can carry flow, for the scheduler's weights.

A max flow algorithm returns one of many maximal flows, and Edmonds-Karp's shortest augmenting paths leave
parallel nodes idle whenever the paths it found first already saturate the cut: on helix-single LLaMA-70B it
sends nothing through t4-10 and t4-11. IWRR routes by the flows, so an idle node's KV and compute are never
used, although a request could take it at no cost to the max flow. `balance` keeps the flow's value and
maximizes the least utilization (flow over capacity) of the nodes that lie on some source-sink path, one LP
(HiGHS through scipy). The bottleneck nodes stay saturated; every other usable node gets a share.
"""

from __future__ import annotations

import math

import networkx as nx
import numpy as np
from scipy.optimize import linprog
from scipy.sparse import lil_matrix

from hetnode.planner.plan import SINK, SOURCE

# The flow value may fall short of the max flow by this share: an LP solver meets equalities to tolerances.
_SLACK = 1e-9


def balance(g: nx.DiGraph, value: float) -> dict[tuple[str, str], float] | None:
    """Edge flows of value `value` on flow graph `g` (capacity attributes; none = unbounded) that maximize the
    least utilization of the usable nodes ("<n>:in" -> "<n>:out" edges); None when the LP fails (the caller
    keeps its own max flow)."""
    if value <= 0:
        return None
    edges = list(g.edges(data="capacity"))
    index = {(u, v): i for i, (u, v, _) in enumerate(edges)}
    on_path = nx.descendants(g, SOURCE) & nx.ancestors(g, SINK)
    nodes = [(u, v) for u, v, _ in edges if u.endswith(":in") and v.endswith(":out") and u in on_path]
    vertices = [x for x in g.nodes if x not in (SOURCE, SINK)]
    n = len(edges)  # variables: one flow per edge, then t (the least utilization) at index n
    t = n
    # Equalities: conservation at every vertex but the source and sink, and the flow out of the source.
    a_eq = lil_matrix((len(vertices) + 1, n + 1))
    for row, x in enumerate(vertices):
        for u, _ in g.in_edges(x):
            a_eq[row, index[(u, x)]] = 1.0
        for _, v in g.out_edges(x):
            a_eq[row, index[(x, v)]] = -1.0
    for _, v in g.out_edges(SOURCE):
        a_eq[len(vertices), index[(SOURCE, v)]] = 1.0
    b_eq = np.zeros(len(vertices) + 1)
    b_eq[-1] = value * (1 - _SLACK)
    # t x capacity <= flow through the node, for every node on a source-sink path.
    a_ub = lil_matrix((len(nodes), n + 1))
    for row, (u, v) in enumerate(nodes):
        cap = g.edges[u, v].get("capacity", math.inf)
        if not math.isfinite(cap):
            continue  # an unbounded node has no utilization to balance
        a_ub[row, t] = cap
        a_ub[row, index[(u, v)]] = -1.0
    bounds = [(0.0, None if cap is None or not math.isfinite(cap) else float(cap)) for _, _, cap in edges]
    bounds.append((0.0, 1.0))
    cost = np.zeros(n + 1)
    cost[t] = -1.0
    result = linprog(cost, A_ub=a_ub.tocsr() if nodes else None, b_ub=np.zeros(len(nodes)) if nodes else None,
                     A_eq=a_eq.tocsr(), b_eq=b_eq, bounds=bounds, method="highs")
    if result.status != 0:
        return None
    x = np.maximum(result.x[:n], 0.0)
    return {(u, v): float(x[i]) for i, (u, v, _) in enumerate(edges)}
