#!/usr/bin/env python
"""Attempts at a connectivity-aware upper bound that binds on helix-geo-pruned (issue 12), measured, not shipped.

Every bound the planner has reports 9876.5 tokens/s there (the compute bound) while the best placement known
has 6838. What limits it is the cost of crossing between regions: flow that crosses from region h into region
g at layer boundary b uses the links from h's nodes ending at b to g's nodes holding b, n_{h,b} x m_{g,b} of
them (763 tokens/s each), and many enders at one boundary (or holders of one layer) cover little else.

`--mode lp` builds one linear program (valid for every placement, partial inference on or off; the proof is
below) over fractional ranges, and solves it with the pivot region's nodes (the A100s' region1 here)
  free         every range fractional,
  ranges       fixed to given ranges (`--pivot a100-0=32:44 ...`): a bound on every placement with those;
               with `--start-width W` each start anywhere in [first - W/2, first + W/2], with `--length-width`
               each length down to that many layers shorter (a box around the given ranges),
  starts       their starts fixed, lengths fractional (`--pivot a100-0=32 ...`),
  boxes        each start in a block of layers, best-first halving of the widest block, `--max-lps` LPs: the
               bound a shipped version would report (the largest value over the open boxes),
  bnb          best-first branch and bound over boxes of starts and lengths, twins' starts ordered
               (`branch_and_bound`), to `--seconds` CPU or `--max-lps`, the bound at 10, 30, 60, ... s,
  integer      their ranges integer (HiGHS's branch-and-bound on the same LP, `--seconds`).
With `--integer-others` (ranges mode) the other regions' range counts are integer as well: a MILP run to
`--seconds`, its dual bound a bound on every placement with the given pivot ranges.
`--mode cuts` is the first attempt: a MILP over integer counts of ranges per class of identical nodes, whose
flow is at most every layer boundary's cut (the throughput of the nodes holding or ending at it) and the cut
of every link between regions (n x m per boundary, linearized with a one-hot of m), run to `--seconds`.

Why the LP bounds every placement: decompose a placement's max flow into paths from the coordinator and back;
f_{g,l} is the flow whose layer l runs in region g, t_{h,g,b} the flow running layer b-1 in h and b in g. Then
sum_g f_{g,l} = F; f_{g,l} <= the T_j of g's nodes holding l; f_{g,0} and f_{g,L-1} at most what the
coordinator's links to and from g's holders of the first and last layer carry; f_{g,b} = f_{g,b-1} + sum_h
t_{h,g,b} - sum_h t_{g,h,b}; sum_g t_{h,g,b} <= the T_j of h's nodes ending at b; t_{h,g,b} <= c_{h,g} x
pairs, c the largest link from h to g. Pairs: into or out of the pivot, per pivot node i, P_{i,b} <= n_{h,b}
and P_{i,b} <= |h| x (i holds b) (out of it: m and "i ends at b"); between other regions McCormick with the
region sizes. An integral placement satisfies all of it (P_{i,b} = n_{h,b} [i holds b]).

    .venv/bin/python scripts/probe_geo_bound.py --mode lp --pivot-mode free
    .venv/bin/python scripts/probe_geo_bound.py --mode lp --pivot-mode ranges \
        --pivot a100-0=32:44 a100-1=44:56 a100-2=56:68 a100-3=68:80
    .venv/bin/python scripts/probe_geo_bound.py --mode lp --pivot-mode boxes --max-lps 35
    .venv/bin/python scripts/probe_geo_bound.py --mode lp --pivot-mode bnb --seconds 60 --max-lps 100000
    .venv/bin/python scripts/probe_geo_bound.py --mode lp --pivot-mode integer --seconds 90
    .venv/bin/python scripts/probe_geo_bound.py --mode lp --pivot-mode ranges --integer-others --seconds 300 \
        --pivot a100-0=32:44 a100-1=44:56 a100-2=56:68 a100-3=68:80
    .venv/bin/python scripts/probe_geo_bound.py --mode cuts --seconds 60
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import highspy
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetnode.planner.bounds import region_groups
from hetnode.planner.cluster import ClusterSpec, load_cluster
from hetnode.planner.flowgraph import link_capacity, upper_bound
from hetnode.planner.heuristics import NodeInfo, node_infos
from hetnode.planner.milp import ModelBuilder, run_highs
from hetnode.planner.model import ModelSpec, model_spec
from hetnode.planner.plan import SINK, SOURCE
from hetnode.planner.profile_sources import profile_table_for

CLUSTERS_DIR = Path(__file__).resolve().parents[1] / "hetnode" / "testnet" / "clusters"
Column = tuple[int, int, int, float, float, float]  # (col, first layer, layers, T_j, from coordinator, to it)


class Caps:
    def __init__(self, cluster: ClusterSpec, model: ModelSpec, infos: Sequence[NodeInfo]) -> None:
        self.cluster, self.model = cluster, model
        self.tmax = {i.name: max(i.throughput, default=0.0) for i in infos}

    def __call__(self, a: str, b: str) -> float:
        ends = [self.tmax[x] for x in (a, b) if x in self.tmax]
        return min(link_capacity(self.cluster, self.model, a, b), *ends)

    def kind(self, info: NodeInfo) -> tuple[object, ...]:
        return (info.region, info.throughput, info.max_layers, info.enters, info.leaves,
                self(SOURCE, info.name), self(info.name, SINK))


class PivotLp:
    """The LP of the module docstring, built once; the pivot's nodes are constrained by column bounds."""

    def __init__(self, cluster: ClusterSpec, model: ModelSpec, infos: Sequence[NodeInfo], pivot: str) -> None:
        L = model.num_layers
        cap = Caps(cluster, model, infos)
        groups = region_groups(infos)
        self.scale = scale = max(1.0, sum(i.best_layer_rate for i in infos) / L)
        self.pivot_nodes = [i.name for i in groups[pivot]]
        self.pivot_kinds = [cap.kind(i) for i in groups[pivot]]  # what a pivot node's columns depend on
        m = ModelBuilder()
        self.flow = m.col(0, math.inf, cost=1.0)
        cols: dict[str, list[Column]] = {g: [] for g in groups}
        self.pivot_cols: list[list[tuple[int, int, int]]] = []  # per pivot node: (col, first, layers)
        self.other_cols: list[int] = []  # every other class's range counts
        units: list[tuple[str, list[NodeInfo], bool]] = [(pivot, [i], True) for i in groups[pivot]]
        others: dict[tuple[object, ...], list[NodeInfo]] = {}
        for g, members in groups.items():
            for info in members if g != pivot else []:
                others.setdefault(cap.kind(info), []).append(info)
        units += [(members[0].region, members, False) for members in others.values()]
        for g, members, is_pivot in units:
            rep = members[0]
            src, snk = cap(SOURCE, rep.name), cap(rep.name, SINK)
            mine: list[tuple[int, int, int]] = []
            for j in range(1, rep.max_layers + 1):
                for s in range(L - j + 1):
                    if rep.may_hold(s, s + j, L) and rep.t(j) > 0:
                        c = m.col(0, float(len(members)))
                        cols[g].append((c, s, j, rep.t(j), src, snk))
                        mine.append((c, s, j))
            if is_pivot:
                self.pivot_cols.append(mine)
            else:
                self.other_cols += [c for c, _, _ in mine]
            if mine:  # every node placed: adding a node to a placement never lowers its max flow
                m.row([(c, 1.0) for c, _, _ in mine], float(len(members)) if is_pivot else 0.0, float(len(members)))
        f = {g: [m.col(0, math.inf) for _ in range(L)] for g in groups}
        for layer in range(L):
            m.row([(self.flow, -1.0)] + [(f[g][layer], 1.0) for g in groups], 0, 0)

        def holding(g: str, b: int) -> list[tuple[int, float]]:
            return [(c, 1.0) for c, s, j, *_ in cols[g] if s <= b < s + j]

        def ending(g: str, b: int) -> list[tuple[int, float]]:
            return [(c, 1.0) for c, s, j, *_ in cols[g] if s + j == b]

        for g in groups:
            for layer in range(L):
                m.row([(f[g][layer], 1.0)] + [(c, -t / scale) for c, s, j, t, *_ in cols[g] if s <= layer < s + j],
                      -math.inf, 0)
            m.row([(f[g][0], 1.0)] + [(c, -min(t, src) / scale) for c, s, _, t, src, _ in cols[g] if s == 0],
                  -math.inf, 0)
            m.row([(f[g][L - 1], 1.0)] + [(c, -min(t, snk) / scale) for c, s, j, t, _, snk in cols[g] if s + j == L],
                  -math.inf, 0)
        link = {(h, g): max((cap(a.name, c.name) for a in groups[h] for c in groups[g]), default=0.0)
                for h in groups for g in groups if h != g}
        for b in range(1, L):
            t: dict[tuple[str, str], int] = {}
            for (h, g), c_hg in link.items():
                if c_hg <= 0:
                    continue  # no link from h to g
                t[h, g] = v = m.col(0, math.inf)
                if not math.isfinite(c_hg):
                    continue  # unlimited: only the enders' throughput bounds it
                w = c_hg / scale
                if pivot in (h, g):
                    into = g == pivot
                    other = h if into else g
                    count = ending(other, b) if into else holding(other, b)
                    pairs = []
                    for node in self.pivot_cols:
                        here = [c for c, s, j in node if (s <= b < s + j if into else s + j == b)]
                        if here:
                            p = m.col(0, math.inf)
                            m.row([(p, 1.0)] + [(c, -1.0) for c, _ in count], -math.inf, 0)
                            m.row([(p, 1.0)] + [(c, -float(len(groups[other]))) for c in here], -math.inf, 0)
                            pairs.append((p, -w))
                    m.row([(v, 1.0), *pairs], -math.inf, 0)
                else:
                    m.row([(v, 1.0)] + [(c, -w * len(groups[g])) for c, _ in ending(h, b)], -math.inf, 0)
                    m.row([(v, 1.0)] + [(c, -w * len(groups[h])) for c, _ in holding(g, b)], -math.inf, 0)
            for h in groups:
                out = [(t[h, g], 1.0) for g in groups if (h, g) in t]
                if out:
                    m.row(out + [(c, -tt / scale) for c, s, j, tt, *_ in cols[h] if s + j == b], -math.inf, 0)
            for g in groups:
                m.row([(f[g][b], 1.0), (f[g][b - 1], -1.0)] + [(t[h, g], -1.0) for h in groups if (h, g) in t]
                      + [(t[g, h], 1.0) for h in groups if (g, h) in t], 0, 0)
        self.highs = m.highs(threads=1, seed=0)
        self.columns = np.array([c for node in self.pivot_cols for c, _, _ in node], dtype=np.int32)
        self.size = (m.num_cols, m.num_rows)

    def solve(self, allowed: Sequence[Mapping[tuple[int, int], bool] | tuple[int, int] | None]) -> float:
        """Per pivot node: None (free), a (first, last) range, or a start block (lo, hi) given as {"block": ...}."""
        upper = []
        for node, rule in zip(self.pivot_cols, allowed, strict=True):
            for _, s, j in node:
                ok = rule is None or (rule == (s, s + j) if isinstance(rule, tuple) else rule.get((s, j), False))
                upper.append(1.0 if ok else 0.0)
        self.highs.changeColsBounds(len(self.columns), self.columns, np.zeros(len(self.columns)), np.array(upper))
        self.highs.run()
        status = self.highs.getModelStatus()
        if status == highspy.HighsModelStatus.kInfeasible:
            return 0.0
        if status != highspy.HighsModelStatus.kOptimal:
            return math.inf
        return max(0.0, float(self.highs.getInfo().objective_function_value)) * self.scale

    def start_rule(self, node: int, lo: int, hi: int) -> dict[tuple[int, int], bool]:
        return {(s, j): lo <= s < hi for _, s, j in self.pivot_cols[node]}


def boxes(lp: PivotLp, L: int, blocks: int, max_lps: int) -> tuple[float, int, int]:
    """Best-first over start blocks (identical pivot nodes share a multiset of blocks: every placement is in a
    root box); returns (the largest value over the open boxes, LPs solved, open boxes)."""
    edges = [L * k // blocks for k in range(blocks + 1)]
    root = [(a, b) for a, b in itertools.pairwise(edges) if b > a]
    n = len(lp.pivot_cols)
    heap: list[tuple[float, int, tuple[tuple[int, int], ...]]] = []
    order = itertools.count()

    def value(box: Sequence[tuple[int, int]]) -> float:
        return lp.solve([lp.start_rule(i, lo, hi) for i, (lo, hi) in enumerate(box)])

    lps = 0
    for box in itertools.combinations_with_replacement(root, n):  # the probe's pivot nodes are identical
        heapq.heappush(heap, (-value(box), next(order), box))
        lps += 1
    while heap and lps < max_lps:
        neg, _, box = heap[0]
        widest = max(range(n), key=lambda i: (box[i][1] - box[i][0], -i))
        lo, hi = box[widest]
        if hi - lo <= 1:
            break
        heapq.heappop(heap)
        for half in ((lo, (lo + hi) // 2), ((lo + hi) // 2, hi)):
            child = tuple(half if i == widest else box[i] for i in range(n))
            heapq.heappush(heap, (-min(-neg, value(child)), next(order), child))
            lps += 1
    return (-heap[0][0] if heap else 0.0), lps, len(heap)


Box = tuple[tuple[int, int, int, int], ...]  # per pivot node: (first start, last start, fewest, most layers)


def branch_and_bound(lp: PivotLp, L: int, incumbent: float, seconds: float, max_lps: int,
                     marks: Sequence[float]) -> list[tuple[float, float, int, int]]:
    """Best-first over boxes of the pivot nodes' ranges (each: an interval of starts and one of lengths).

    Valid when stopped at any point: every placement's pivot ranges (sorted, below) lie in an open box, since
    children partition their parent, and a box's value, min(its LP, its parent's), is at least the max flow of
    every placement in it (module docstring; a box only sets column bounds, so its LP relaxes each of them).
    Symmetry: neighbouring pivot nodes of the same kind (T_j, layer limit, coordinator links: all that their
    columns depend on; the LP sees a region's largest link, not a node's) are interchangeable in the LP, so the
    placement with their ranges sorted by start has the same LP value; the search keeps only what sorted
    ranges can be: a twin's first start at least its predecessor's, its last start at most its successor's
    (every sorted point of a box stays in it). Split: the widest start interval at its middle, else the widest
    length interval. Returns (seconds CPU, bound, LPs, open boxes) at each mark and at the end.
    """
    n = len(lp.pivot_cols)
    twins = [(a, a + 1) for a in range(n - 1) if lp.pivot_kinds[a] == lp.pivot_kinds[a + 1]]

    def tighten(box: Box) -> Box | None:
        b = [list(x) for x in box]
        for a, c in twins:
            b[c][0] = max(b[c][0], b[a][0])
        for a, c in reversed(twins):
            b[a][1] = min(b[a][1], b[c][1])
        if any(x[0] > x[1] or x[2] > x[3] for x in b):
            return None
        return tuple((x[0], x[1], x[2], x[3]) for x in b)

    def value(box: Box) -> float:
        return lp.solve([{(s, j): s0 <= s <= s1 and j0 <= j <= j1 for _, s, j in node}
                         for node, (s0, s1, j0, j1) in zip(lp.pivot_cols, box, strict=True)])

    began = time.process_time()
    root = tighten(tuple((0, L - 1, 1, max(j for _, _, j in node)) for node in lp.pivot_cols))
    assert root is not None
    first = value(root)
    heap: list[tuple[float, int, Box]] = [(-first, 0, root)]
    order = itertools.count(1)
    lps, log, marks_left = 1, [], list(marks)
    while heap:
        top, elapsed = -heap[0][0], time.process_time() - began
        while marks_left and elapsed >= marks_left[0]:
            log.append((marks_left.pop(0), top, lps, len(heap)))
            print(f"  {log[-1][0]:.0f} s: bound {top:.1f}, {lps} LPs, {len(heap)} open", flush=True)
        if top <= incumbent * 1.001 or elapsed >= seconds or lps >= max_lps:
            break
        _, _, box = heapq.heappop(heap)
        i = max(range(n), key=lambda k: (box[k][1] - box[k][0], -k))
        if box[i][1] == box[i][0]:
            i = max(range(n), key=lambda k: (box[k][3] - box[k][2], -k))
        s0, s1, j0, j1 = box[i]
        if (s0, j0) == (s1, j1):
            heapq.heappush(heap, (-top, next(order), box))  # the pivot's ranges fixed: nothing left to split
            break
        kids = ([(s0, (s0 + s1) // 2, j0, j1), ((s0 + s1) // 2 + 1, s1, j0, j1)] if s1 > s0
                else [(s0, s1, j0, (j0 + j1) // 2), (s0, s1, (j0 + j1) // 2 + 1, j1)])
        for kid in kids:
            child = tighten(tuple(kid if k == i else box[k] for k in range(n)))
            if child is not None:
                heapq.heappush(heap, (-min(top, value(child)), next(order), child))
                lps += 1
    log.append((time.process_time() - began, -heap[0][0] if heap else 0.0, lps, len(heap)))
    print(f"  open boxes below the root's bound ({first:.1f}): {sum(-v < first - 0.5 for v, _, _ in heap)}; "
          f"smallest open: {-max(v for v, _, _ in heap) if heap else 0.0:.1f}")
    return log


def cut_milp(cluster: ClusterSpec, model: ModelSpec, infos: Sequence[NodeInfo], seconds: float) -> str:
    """The first attempt (module docstring, --mode cuts): its dual bound after `seconds`."""
    L = model.num_layers
    cap = Caps(cluster, model, infos)
    groups = region_groups(infos)
    classes: dict[tuple[object, ...], list[NodeInfo]] = {}
    for info in infos:
        classes.setdefault(cap.kind(info), []).append(info)
    scale = max(1.0, sum(i.best_layer_rate for i in infos) / L)
    m = ModelBuilder()
    flow = m.col(0, math.inf, cost=1.0)
    x: dict[tuple[str, int, int], list[int]] = {}
    cols: list[tuple[int, str, int, int, float, float, float]] = []
    for members in classes.values():
        rep = members[0]
        src, snk = cap(SOURCE, rep.name), cap(rep.name, SINK)
        mine = []
        for j in range(1, rep.max_layers + 1):
            for s in range(L - j + 1):
                if rep.may_hold(s, s + j, L):
                    c = m.col(0, len(members), integral=True)
                    cols.append((c, rep.region, s, j, rep.t(j), src, snk))
                    x.setdefault((rep.region, s, j), []).append(c)
                    mine.append((c, 1.0))
        m.row(mine, -math.inf, len(members))
    for b in range(L + 1):  # the cut at boundary b: every node holding or ending at it, or its first/last edge
        terms = [(flow, -1.0)]
        for c, _, s, j, t, src, snk in cols:
            if b == 0 and s == 0:
                terms.append((c, min(t, src) / scale))
            elif b == L and s + j == L:
                terms.append((c, min(t, snk) / scale))
            elif 0 < b < L and s < b <= s + j:
                terms.append((c, t / scale))
        m.row(terms, 0, math.inf)
    alone = sum(sum(i.best_layer_rate for i in mem) / L for mem in groups.values()
                if any(i.enters for i in mem) and any(i.leaves for i in mem) and sum(i.max_layers for i in mem) >= L)
    cross = [(flow, -1.0)]
    onehot = {}
    for g, mem in groups.items():
        for b in range(1, L):
            ys = [m.col(0, 1, integral=True) for _ in range(len(mem) + 1)]
            onehot[g, b] = ys
            m.row([(y, 1.0) for y in ys], 1, 1)
            m.row([(c, 1.0) for c, r, s, j, *_ in cols if r == g and s <= b < s + j]
                  + [(y, -float(k)) for k, y in enumerate(ys)], 0, 0)
    for h in groups:
        for g in groups:
            c_hg = max((cap(a.name, c.name) for a in groups[h] for c in groups[g]), default=0.0) if h != g else 0.0
            for b in range(1, L) if c_hg > 0 else []:
                enders = [(c, -1.0) for c, r, s, j, *_ in cols if r == h and s + j == b]
                for k, y in enumerate(onehot[g, b][1:], 1):
                    z = m.col(0, math.inf)
                    m.row([(z, 1.0), *enders], -math.inf, 0)
                    m.row([(z, 1.0), (y, -float(len(groups[h])))], -math.inf, 0)
                    cross.append((z, k * c_hg / scale))
    m.row(cross, -alone / scale, math.inf)
    solver = m.highs(threads=1, seed=0)
    r = run_highs(solver, scale=scale, time_limit=seconds)
    return f"cut MILP: {m.num_cols} columns, {m.num_rows} rows: dual bound {r.bound:.1f} after {r.time_s:.0f} s, " \
           f"{r.nodes} branch-and-bound nodes ({r.status})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cluster", default="helix-geo-pruned")
    ap.add_argument("--model", default="llama-70b")
    ap.add_argument("--mode", choices=("lp", "cuts"), default="lp")
    ap.add_argument("--pivot-mode", choices=("free", "ranges", "starts", "boxes", "bnb", "integer"), default="free")
    ap.add_argument("--pivot", nargs="*", default=[], help="node=first:last (ranges) or node=first (starts)")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--max-lps", type=int, default=35)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--start-width", type=int, default=0, help="ranges: each start within this many layers")
    ap.add_argument("--length-width", type=int, default=0, help="ranges: each length up to this many shorter")
    ap.add_argument("--incumbent", type=float, default=6838.0, help="bnb stops below it x 1.001")
    ap.add_argument("--integer-others", action="store_true",
                    help="ranges: the other regions' range counts integer (a MILP, run to --seconds)")
    args = ap.parse_args()
    path = Path(args.cluster)
    cluster = load_cluster(path if path.suffix == ".toml" else CLUSTERS_DIR / f"{args.cluster}.toml")
    model = model_spec(args.model)
    table = profile_table_for(cluster, model, "auto")
    infos = node_infos(cluster, model, table)
    print(f"{cluster.name}, {model.name}: compute bound {upper_bound(cluster, model, table):.1f}")
    began = time.process_time()
    if args.mode == "cuts":
        print(cut_milp(cluster, model, infos, args.seconds))
        return
    groups = region_groups(infos)
    pivot = max(groups, key=lambda g: (sum(i.best_layer_rate for i in groups[g]), g))
    lp = PivotLp(cluster, model, infos, pivot)
    print(f"pivot {pivot} ({', '.join(lp.pivot_nodes)}); LP {lp.size[0]} columns, {lp.size[1]} rows, "
          f"built in {time.process_time() - began:.1f} s CPU")
    began = time.process_time()
    given = dict(p.split("=", 1) for p in args.pivot)
    if args.pivot_mode == "boxes":
        value, lps, left = boxes(lp, model.num_layers, args.blocks, args.max_lps)
        print(f"boxes: bound {value:.1f} after {lps} LPs, {left} boxes open, {time.process_time() - began:.1f} s CPU")
        return
    if args.pivot_mode == "bnb":
        log = branch_and_bound(lp, model.num_layers, args.incumbent, args.seconds, args.max_lps,
                               (10, 30, 60, 120, 240, 480))
        at, value, lps, left = log[-1]
        print(f"bnb: bound {value:.1f} after {lps} LPs, {left} boxes open, {at:.1f} s CPU")
        return
    if args.pivot_mode == "integer":
        for c in lp.columns:
            lp.highs.changeColIntegrality(int(c), highspy.HighsVarType.kInteger)
        r = run_highs(lp.highs, scale=lp.scale, time_limit=args.seconds)
        print(f"integer: {len(lp.columns)} integer columns: dual bound {r.bound:.1f} after {r.time_s:.0f} s, "
              f"{r.nodes} branch-and-bound nodes ({r.status})")
        return
    rules: list[Mapping[tuple[int, int], bool] | tuple[int, int] | None] = []
    for i, name in enumerate(lp.pivot_nodes):
        if args.pivot_mode == "free":
            rules.append(None)
        elif args.pivot_mode == "ranges" and (args.start_width or args.length_width):
            first, last = (int(v) for v in given[name].split(":"))
            lo, hi = first - args.start_width // 2, first + args.start_width - args.start_width // 2
            few = last - first - args.length_width
            rules.append({(s, j): lo <= s <= hi and few <= j <= last - first for _, s, j in lp.pivot_cols[i]})
        elif args.pivot_mode == "ranges":
            first, last = (int(v) for v in given[name].split(":"))
            rules.append((first, last))
        else:
            s = int(given[name])
            rules.append(lp.start_rule(i, s, s + 1))
    if args.integer_others:
        for c in lp.other_cols:
            lp.highs.changeColIntegrality(c, highspy.HighsVarType.kInteger)
        lp.highs.setOptionValue("time_limit", args.seconds)
    value = lp.solve(rules)
    if args.integer_others:
        info = lp.highs.getInfo()
        print(f"integer others, {len(lp.other_cols)} integer columns: dual bound {info.mip_dual_bound * lp.scale:.1f}, "
              f"best placement {info.objective_function_value * lp.scale:.1f} after "
              f"{time.process_time() - began:.0f} s CPU, {info.mip_node_count} branch-and-bound nodes")
        return
    print(f"{args.pivot_mode} {' '.join(args.pivot)}: bound {value:.1f} ({time.process_time() - began:.2f} s CPU)")


if __name__ == "__main__":
    main()
