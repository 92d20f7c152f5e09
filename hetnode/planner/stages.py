"""Stage placements: the layers cut into consecutive stages, each held whole by a group of nodes.

A stage [a, a + z) held by a group of nodes (each holding exactly those z layers) serves sum T_z over the
group; the next stage's group takes over at a + z, every node of one group feeding every node of the next.
With the links fast enough, the max flow of such a placement is its weakest stage -- the least coverage --
and the question "is there a stage placement whose every stage serves at least F?" is a small search:
choose the first stage's length and group, then the rest from what is left. Swarm's placement is one stage
placement (equal stages, groups balanced by throughput); separate pipelines are not, but mixed groups of
short stages for big GPUs and long ones for small GPUs often beat both.

`stage_placement` answers the question by depth-first search over (layers placed, nodes left per class),
trying for each stage length only *minimal* groups (no member can leave without the stage falling below
F), cheapest first (the throughput the group gives up against its best layer count, plus what it serves
above F), and remembering the states that failed. A class is a set of interchangeable nodes: the same
throughput table and, when `region_links` is given, the same region; then every stage stays inside one
region and a stage boundary between two regions must carry F over the links between the two groups
(|A| x |B| links of the regions' capacity, each end limited by its node's throughput). `best_stage_placement`
bisects on F. Exhaustive within its family, so an infeasible answer is exact for stage placements (not for
placements in general). A class also shares its links to the coordinator (`NodeInfo.enters`, `leaves`): the
first stage goes only to nodes the coordinator sends to, the last only to nodes that send back to it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hetnode.planner.heuristics import NodeInfo, Ranges

Group = tuple[tuple[int, int], ...]  # (class index, how many nodes) for one stage
STEP = 0.05  # best_stage_placement's largest step above the best level so far
MAX_GROUP = 6  # with regions: groups of up to this many nodes are tried, so that boundaries have enough links


class _Timeout(Exception):
    pass


@dataclass(frozen=True)
class _Class:
    throughput: tuple[float, ...]
    region: str
    members: tuple[str, ...]
    enters: bool = True
    leaves: bool = True

    @property
    def best_rate(self) -> float:
        return max(j * t for j, t in enumerate(self.throughput, 1))

    def t(self, layers: int) -> float:
        return self.throughput[layers - 1] if 1 <= layers <= len(self.throughput) else 0.0


def _classes(infos: Sequence[NodeInfo], by_region: bool) -> list[_Class]:
    groups: dict[tuple[tuple[float, ...], str, bool, bool], list[str]] = {}
    for info in infos:
        key = (info.throughput, info.region if by_region else "", info.enters, info.leaves)
        groups.setdefault(key, []).append(info.name)
    return [_Class(t, r, tuple(sorted(m)), enters, leaves) for (t, r, enters, leaves), m in groups.items()]


def stage_placement(infos: Sequence[NodeInfo], num_layers: int, level: float, *, deadline: float,
                    region_links: Callable[[str, str], float] | None = None,
                    steps: list[int] | None = None, last_min: int = 1) -> tuple[str, Ranges | None]:
    """("feasible", ranges) for a stage placement serving `level` tokens/s at every stage, ("infeasible",
    None) when there is none, ("unknown", None) when `deadline` (perf_counter) passes first or the search
    runs out of `steps` (a one-element list counting down the search states it may still expand: a
    deterministic limit, the same on a loaded machine as on an idle one).

    `region_links(a, b)`: tokens/s one link from region a to region b carries; given, stages stay within a
    region and cross-region boundaries must carry `level`. `last_min`: the last stage's group has at least
    this many nodes (a branch's last group feeds another region's nodes, each over links of its own)."""
    classes = _classes(infos, region_links is not None)
    count = len(classes)
    rates = [c.best_rate for c in classes]
    # The most layers one node of a class can cover at `level`: holding z layers it covers z of them if it
    # serves `level` alone, else the share t(z) / level of them (the rest of its stage's group covers the
    # rest). Every stage's group covers its z layers this way, so the nodes left must reach the layers left.
    # Tighter than throughput x layers where a node serves more than `level` (an A100 does not cover 22
    # layers at 5000 tokens/s when it holds at most 12): on helix-geo-pruned the search spent most of its
    # states tiling the middle region in ways that could never leave enough of the A100s' 12-layer reach.
    reach = [max((z * min(1.0, c.t(z) / level) if level > 0 else float(z)
                  for z in range(1, len(c.throughput) + 1)), default=0.0) for c in classes]
    failed: set[tuple[int, tuple[int, ...], str, int]] = set()

    crossing = region_links is not None and len({c.region for c in classes}) > 1

    def groups(layer: int, z: int, left: tuple[int, ...], region: str | None,
               min_size: int) -> list[tuple[float, Group]]:
        """Groups serving `level` on layers [layer, layer + z) with at least `min_size` members, from which no
        member can leave without breaking one of the two, with their cost (throughput wasted per layer)."""
        usable = sorted(((classes[c].t(z), c) for c in range(count)
                         if left[c] > 0 and classes[c].t(z) > 0 and (region is None or classes[c].region == region)
                         and (layer > 0 or classes[c].enters) and (layer + z < num_layers or classes[c].leaves)),
                        reverse=True)
        out: list[tuple[float, Group]] = []

        def extend(i: int, total: float, size: int, chosen: list[tuple[int, int]]) -> None:
            if i == len(usable):
                if total < level or size < min_size:
                    return
                smallest = min(classes[c].t(z) for c, _ in chosen)
                if total - smallest >= level and size - 1 >= min_size:
                    return  # not minimal
                group = tuple(chosen)
                lost = sum(n * (rates[c] - z * classes[c].t(z)) for c, n in group) + z * (total - level)
                out.append((lost / z, group))
                return
            t, c = usable[i]
            rest = sum(tt * left[cc] for tt, cc in usable[i:])
            if total + rest < level or size + sum(left[cc] for _, cc in usable[i:]) < min_size:
                return
            most = min(left[c], max(math.ceil((level - total) / t), min_size - size, 0))
            for n in range(most, -1, -1):
                extend(i + 1, total + n * t, size + n, [*chosen, (c, n)] if n else chosen)

        extend(0, 0.0, 0, [])
        return out

    regions = sorted({c.region for c in classes}) if region_links is not None else [""]
    sizes = range(1, MAX_GROUP + 1) if crossing else range(1, 2)
    in_region = {r: [c for c in range(count) if region_links is None or classes[c].region == r] for r in regions}
    longest = {r: max((len(classes[c].throughput) for c in in_region[r]), default=0) for r in regions}
    known: dict[tuple[str, int, tuple[int, ...], bool, bool], list[tuple[Group, float, int, float]]] = {}

    def candidates(layer: int, z: int, left: tuple[int, ...], mine: tuple[int, ...],
                   region: str) -> list[tuple[Group, float, int, float]]:
        """Every size's minimal groups for a stage of z layers in `region` (group, cost, size, throughput).
        They depend on `left` only through the region's classes (`mine`) and on `layer` only through whether
        the stage is the first or the last, so they are remembered by that key: most states of the search
        share them, and building them was 80% of its time (profiled on helix-geo-pruned)."""
        last = layer + z == num_layers
        key = (region, z, mine, layer == 0, last)
        found = known.get(key)
        if found is None:
            unique = {group: cost for m in (range(last_min, last_min + 1) if last and last_min > 1 else sizes)
                      for cost, group in groups(layer, z, left, region if region_links is not None else None, m)}
            found = known[key] = [(group, cost, sum(n for _, n in group),
                                   sum(n * classes[c].t(z) for c, n in group)) for group, cost in unique.items()]
        return found

    def transfer(prev: tuple[str, int, float], region: str, size: int, serves: float) -> float:
        """What the boundary between the previous group and this one carries."""
        prev_region, prev_size, prev_serves = prev
        if region_links is None or prev_region == region or not prev_size:
            return math.inf
        link = region_links(prev_region, region)
        return min(prev_serves, serves, prev_size * size * link)

    def search(layer: int, left: tuple[int, ...], prev: tuple[str, int, float]) -> list[tuple[int, int, Group]] | None:
        if steps is not None:
            steps[0] -= 1
            if steps[0] < 0:
                raise _Timeout
        if time.perf_counter() > deadline:
            raise _Timeout
        if layer == num_layers:
            return []
        key = (layer, left, prev[0], prev[1])
        if key in failed:
            return None
        if sum(n * r for n, r in zip(left, reach, strict=True)) < (num_layers - layer) * (1 - 1e-12):
            failed.add(key)
            return None
        options: list[tuple[float, int, int, Group, str]] = []
        for region in regions:
            mine = tuple(left[c] for c in in_region[region])
            if not any(mine):
                continue
            # No node of the region holds more than its longest range.
            for z in range(1, min(num_layers - layer, longest[region]) + 1):
                for group, cost, size, serves in candidates(layer, z, left, mine, region):
                    if transfer(prev, region, size, serves) < level:
                        continue
                    options.append((cost, -z, z, group, region))
        options.sort(key=lambda o: (o[0], o[1], o[4], o[3]))
        for _, _, z, group, region in options:
            rest = list(left)
            for c, n in group:
                rest[c] -= n
            size = sum(n for _, n in group)
            serves = sum(n * classes[c].t(z) for c, n in group)
            tail = search(layer + z, tuple(rest), (region, size, serves))
            if tail is not None:
                return [(layer, z, group), *tail]
        failed.add(key)
        return None

    try:
        stages = search(0, tuple(len(c.members) for c in classes), ("", 0, 0.0))
    except _Timeout:
        return "unknown", None
    if stages is None:
        return "infeasible", None
    ranges: Ranges = {}
    taken = [0] * count
    for first, z, group in stages:
        for c, n in group:
            for name in classes[c].members[taken[c]:taken[c] + n]:
                ranges[name] = (first, first + z)
            taken[c] += n
    return "feasible", ranges


@dataclass
class StageResult:
    ranges: Ranges | None  # the best stage placement found (nodes it leaves out are not in it)
    value: float  # its least coverage, tokens/s
    below: float  # no stage placement serves this much (inf when nothing was proven)
    steps: list[tuple[float, str, float]]  # (level tried, outcome, seconds)


def best_stage_placement(infos: Sequence[NodeInfo], num_layers: int, *, low: float, high: float,
                         time_limit: float, precision: float = 0.002,
                         region_links: Callable[[str, str], float] | None = None,
                         on_found: Callable[[Ranges, float], None] | None = None,
                         step_limit: int | None = None) -> StageResult:
    """Bisect on the level between `low` and `high` (tokens/s) for the best stage placement.

    With `step_limit`, each level gets half the search states left (as it gets half the time left), so the
    outcome does not depend on the machine's speed unless `time_limit` cuts in first."""
    began = time.perf_counter()
    result = StageResult(None, 0.0, math.inf, [])
    look = high
    budget = step_limit
    # The depth-first search can be stuck at one level and quick at a higher one (on helix-hetero-pruned,
    # 500k states at 16966 tokens/s ran out, while 17200 is feasible in a moment): after the first "unknown"
    # the next level tried is half-way above it, once, before the search looks lower.
    above: float | None = None
    tried_above = False
    while look - low > precision * high:
        left = time_limit - (time.perf_counter() - began)
        if left <= 0.01 or (budget is not None and budget < 2):
            break
        # Never more than STEP above the best level found: the bound above is often loose (helix-geo-pruned:
        # 9877 against a best of about 6300), levels far above the best end "unknown" after the whole of
        # their budget, while a feasible answer usually lands well above the level asked (5000 -> 5523).
        level = above if above is not None else min((low + look) / 2, max(low, result.value) * (1 + STEP)) \
            if low > 0 else (low + look) / 2
        above = None
        # A level gets half of what is left (3/4 lost helix-hetero-pruned's levels below its first "unknown").
        share = budget // 2 if budget is not None else 0
        steps = None if budget is None else [share]
        outcome, ranges = stage_placement(infos, num_layers, level, deadline=time.perf_counter() + left / 2,
                                          region_links=region_links, steps=steps)
        if budget is not None and steps is not None:
            budget -= share - max(0, steps[0])
        result.steps.append((level, outcome, time.perf_counter() - began))
        if outcome == "feasible" and ranges is not None:
            value = _least(infos, ranges, num_layers)
            low = max(low, value)
            if low >= look:  # found above where the search was looking: look up to what is not proven again
                look = min(high, result.below)
            if value > result.value:
                result.ranges, result.value = ranges, value
                if on_found is not None:
                    on_found(ranges, value)
        else:
            if outcome == "unknown" and not tried_above:
                tried_above = True
                above = min((level + min(high, result.below)) / 2, level * (1 + STEP))
            look = min(look, level)  # an unknown "above" try does not raise where to look
            if outcome == "infeasible":
                result.below = min(result.below, level)
    return result


def _least(infos: Sequence[NodeInfo], ranges: Ranges, num_layers: int) -> float:
    cov = [0.0] * (num_layers + 1)
    for info in infos:
        if info.name in ranges:
            first, last = ranges[info.name]
            cov[first] += info.t(last - first)
            cov[last] -= info.t(last - first)
    total, least = 0.0, math.inf
    for layer in range(num_layers):
        total += cov[layer]
        least = min(least, total)
    return least
