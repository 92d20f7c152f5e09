"""Branch placements: regions in parallel, each running the model's first layers, all feeding one region's tail.

The regional stage search (stages.py) keeps every stage inside one region and runs the regions in series, so
every boundary between two regions must carry the whole flow over the few links between two groups. On a
geo-distributed cluster whose fast GPUs sit in one region (helix-geo-pruned: four A100s in the coordinator's
region, L4s and T4s in two others behind 100 Mb/s links) the better placements run the other regions side by
side: each runs layers [0, e) on its own share of the flow, and its last group hands over to the first group
of the fast region's tail [b, L), every member over its own links (the best known placement, 6838 tokens/s,
has this shape; the series of regions stops at 6104-6312).

`branch_placement` builds such placements from stage placements: for a tail region h and a tail start b, the
tail is the best stage placement of h's nodes over [b, L); each other region r reached by the coordinator is
a branch, the best stage placement of its nodes over [0, e) at a level F_r whose last group has at least
F_r / (g0 x link(r, h)) members (g0: the tail's first group; with partial inference e may lie anywhere in
that group's range, without it e = b). The placement serves at most min(tail level, sum of F_r); every b is
tried and the candidates reported best first. A branch's stages are stage placements (stages.py), so the same
search states count down one deterministic limit.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hetnode.planner.heuristics import NodeInfo, Ranges
from hetnode.planner.stages import _Timeout, stage_placement

PRECISION = 0.005  # bisection on a branch's or the tail's level stops within this share


@dataclass
class Branches:
    ranges: Ranges  # every node the placement uses (nodes left out are not in it)
    estimate: float  # min(tail level, sum of the branches' levels), tokens/s
    tail: str
    start: int  # the tail's first layer


def _best_level(run: Callable[[float], Ranges | None], high: float) -> tuple[float, Ranges | None]:
    """The highest level (within PRECISION of `high`) at which `run` finds a placement, bisecting on
    (0, high]; (0, None) when there is none above PRECISION x high."""
    low, found = 0.0, None
    top = high
    if high <= 0:
        return 0.0, None
    ranges = run(high)
    if ranges is not None:
        return high, ranges
    while high - low > PRECISION * top:
        level = (low + high) / 2
        ranges = run(level)
        if ranges is None:
            high = level
        else:
            low, found = level, ranges
    return low, found


def branch_placements(infos: Sequence[NodeInfo], num_layers: int, *, link: Callable[[str, str], float],
                      partial: bool, time_limit: float, step_limit: int,
                      on_found: Callable[[Branches], None] | None = None) -> list[Branches]:
    """Branch placements, best estimate first (empty when the cluster has one region or none is feasible).

    `link(a, b)`: tokens/s one link from region a to region b carries. `step_limit`: search states in all, a
    deterministic limit (the clock's `time_limit` is a safety net). `on_found` hears each placement as soon
    as it is built, so that one the clock cuts short still hands over what it found."""
    deadline = time.perf_counter() + time_limit
    steps = [step_limit]
    members: dict[str, list[NodeInfo]] = {}
    for info in infos:
        members.setdefault(info.region, []).append(info)
    out: list[Branches] = []
    if len(members) < 2:
        return out

    def stages(nodes: Sequence[NodeInfo], layers: int, level: float, last_min: int = 1) -> Ranges | None:
        if steps[0] <= 0 or time.perf_counter() > deadline:
            raise _Timeout
        outcome, ranges = stage_placement(nodes, layers, level, deadline=deadline, steps=steps, last_min=last_min)
        if outcome == "unknown":
            raise _Timeout
        return ranges

    def rate(nodes: Sequence[NodeInfo]) -> float:
        return sum(i.best_layer_rate for i in nodes)

    branch_memo: dict[tuple[str, int, float], tuple[float, Ranges | None]] = {}

    def branch(region: str, end: int, per_link: float) -> tuple[float, Ranges | None]:
        """The best level of `region`'s nodes over [0, end) whose last group feeds the tail over links of
        `per_link` tokens/s each (one per member and tail-group node)."""
        key = (region, end, per_link)
        if key not in branch_memo:
            nodes = [replace(i, leaves=True) for i in members[region]]
            high = min(rate(nodes) / end, per_link * len(nodes),
                       sum(i.t(1) for i in nodes if i.enters))
            branch_memo[key] = _best_level(
                lambda level: stages(nodes, end, level, max(1, math.ceil(level / per_link * (1 - 1e-9)))), high)
        return branch_memo[key]

    def tail_run(nodes: Sequence[NodeInfo], span: int) -> Callable[[float], Ranges | None]:
        return lambda level: stages(nodes, span, level)

    try:
        for tail in sorted(members, key=lambda r: -rate(members[r])):
            heads = [r for r in sorted(members) if r != tail and any(i.enters for i in members[r])]
            if not heads or not any(i.leaves for i in members[tail]):
                continue
            tail_nodes = [replace(i, enters=True) for i in members[tail]]
            most = max(i.max_layers for i in tail_nodes) * len(tail_nodes)
            # The tail's level rises with its start and the branches' falls (more layers each): walk the
            # starts up from the longest tail, skip a start whose tail cannot beat the best estimate, and stop
            # once the branches limit the flow and have fallen below it.
            best = 0.0
            for start in range(max(1, num_layers - most), num_layers):
                span = num_layers - start
                level, ranges = _best_level(tail_run(tail_nodes, span),
                                            min(rate(tail_nodes) / span, max(i.t(1) for i in tail_nodes)
                                                * len(tail_nodes)))
                if ranges is None or level <= best:
                    continue
                placed = {n: (first + start, last + start) for n, (first, last) in ranges.items()}
                first_group = [n for n, (first, _) in placed.items() if first == start]
                z0 = placed[first_group[0]][1] - start
                total = 0.0
                for region in heads:
                    per_link = link(region, tail) * len(first_group)
                    if per_link <= 0:
                        continue
                    found: tuple[float, Ranges | None] = (0.0, None)
                    for end in range(start, start + z0) if partial else (start,):
                        found = max(found, branch(region, end, per_link), key=lambda x: x[0])
                    if found[1] is not None:
                        total += found[0]
                        placed.update(found[1])
                estimate = min(level, total)
                if estimate > 0:
                    out.append(Branches(placed, estimate, tail, start))
                    if on_found is not None:
                        on_found(out[-1])
                if total <= level and total <= best:
                    break
                best = max(best, estimate)
    except _Timeout:
        pass
    out.sort(key=lambda b: -b.estimate)
    return out
