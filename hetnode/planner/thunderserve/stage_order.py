"""The order of a pipeline's stages: the path through them that costs least to cross (Appendix B, step 2).

A bitmask dynamic program over the set of blocks visited and the last one, Held-Karp style: best[mask][b] is
the least total crossing cost of a path that visits exactly `mask` and ends at b. The path may start and end
anywhere. `cost[a][b]` is the time to send one activation batch from a to b (alpha-beta, inf without a link).

Appendix B describes the program as maximizing the path's bottleneck bandwidth; this one minimizes the sum of
the crossing times, which is what enters a request's latency, and which a dynamic program solves exactly
(the bottleneck with a sum as tie-break does not decompose by prefix). The cost of the slowest hop is still
what limits a pipeline's throughput, and parallel.py prices it.

The blocks are a group's hosts, each host's stages kept together: the links inside a host are at least as
fast as those leaving it in every shipped file, so visiting a host twice only adds crossings, and at most
MAX_BLOCKS hosts keep the program at 2^n n^2 steps. Past that the path is greedy (nearest next block from
each start).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

MAX_BLOCKS = 12


def best_order(cost: Sequence[Sequence[float]]) -> tuple[list[int], float]:
    """The visiting order of blocks 0..n-1 with the least total cost, and that cost."""
    n = len(cost)
    if n == 0:
        return [], 0.0
    if n > MAX_BLOCKS:
        return _greedy(cost)
    full = (1 << n) - 1
    best = [[math.inf] * n for _ in range(1 << n)]
    parent = [[-1] * n for _ in range(1 << n)]
    for b in range(n):
        best[1 << b][b] = 0.0
    for mask in range(1, full + 1):
        row = best[mask]
        for last in range(n):
            here = row[last]
            if here == math.inf:
                continue
            for nxt in range(n):
                if mask >> nxt & 1:
                    continue
                value = here + cost[last][nxt]
                if value < best[mask | 1 << nxt][nxt]:
                    best[mask | 1 << nxt][nxt] = value
                    parent[mask | 1 << nxt][nxt] = last
    end = min(range(n), key=lambda b: best[full][b])
    total = best[full][end]
    if total == math.inf:
        return list(range(n)), math.inf
    order = [end]
    mask = full
    while parent[mask][order[-1]] >= 0:
        last = order[-1]
        order.append(parent[mask][last])
        mask ^= 1 << last
    order.reverse()
    return order, total


def path_cost(cost: Sequence[Sequence[float]], order: Sequence[int]) -> float:
    return sum(cost[a][b] for a, b in itertools.pairwise(order))


def _greedy(cost: Sequence[Sequence[float]]) -> tuple[list[int], float]:
    n = len(cost)
    best: tuple[float, list[int]] | None = None
    for start in range(n):
        order = [start]
        left = set(range(n)) - {start}
        while left:
            nxt = min(left, key=lambda b: (cost[order[-1]][b], b))
            order.append(nxt)
            left.remove(nxt)
        total = path_cost(cost, order)
        if best is None or total < best[0]:
            best = (total, order)
    assert best is not None
    return best[1], best[0]
