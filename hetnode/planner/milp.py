"""Helix's model-placement MILP (§4.4, Tables 5 and 6), solved with HiGHS.

Variables (Table 5): per node i, s_i (integer, first layer) and b_i^j (binary, holds j layers, j = 1..k_i);
per directed connection e = (u, v) of the (possibly pruned) graph, including the coordinator's source and
sink edges, f_e (flow, tokens/s) and d_e (binary, valid); with partial inference and the paper's
formulation also cond1_e and cond2_e. Constraints (Table 6): one layer count per node; s_i <= L - 1 and
e_i = s_i + sum_j j b_i^j <= L; flow conservation; node throughput sum_in f <= sum_j T_j b_i^j; connection
validity (source: s_i = 0; sink: e_i = L; node to node: s_v <= e_u < e_v with partial inference, e_u = s_v
without); transmission f_e <= d_e S_e. Objective: max sum_i f_(source, i).

The formulation exactly as printed (`formulation="paper"`) is weak: the coordinator's links carry token ids
(4 bytes), so their S is millions of tokens per second and f <= d S constrains nothing once d is fractional,
and every node claims its one-layer throughput T_1 in the LP relaxation. Cold, on the 24-node LLaMA-70B
cluster (helix-geo), HiGHS finds no placement with non-zero flow in 60 s and its LP bound is 790120 tokens/s,
80x the compute bound of 9877 and 130x the best flows found. `formulation="tight"` (the default) has the
same integer points and an honest relaxation:

- flow bounds f_e <= d_e min(S_e, T_max(u), T_max(v)): nothing leaves a node faster than it computes;
- big-M as small as stays valid: L - 1 for the source rows, e_u >= 1 + (L - 1) d for the sink rows, L - 2
  and L for the two node-to-node rows; cond1/cond2 are folded into d (d <= cond1 and d <= cond2 with
  nothing else on cond: the same integer points, a tighter relaxation);
- the compute cut (Helix §4.5's bound, made per node): every token runs each of the L layers on some node, so
  L x F <= sum_i (layers on i) x (flow through i). With the node flow split by layer count, g_i^j <= T_j b_i^j
  and sum_j g_i^j = flow through i, this is linear: L F <= sum_i sum_j j g_i^j. The relaxation's bound drops
  from sum_i T_1 to sum_i max_j j T_j / L (`flowgraph.upper_bound`) at most, and below it once b is fixed;
- symmetry breaking: nodes that are interchangeable (same profile, same capacity to every other endpoint,
  `symmetry_groups`) are ordered, s_a <= s_b.

Even so, branch and bound alone does not move a good warm start on the 24-node clusters (the relaxation of
"which layers does each node hold" through s and b is a big-M one); `lns.py` searches around the incumbent
with a position-indexed model of a few freed nodes, and this model serves small clusters, the final solve
and the ablation. What each technique buys, measured: placement.py's docstring.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import highspy
import numpy as np

from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.flowgraph import connects, link_capacity
from hetnode.planner.heuristics import NodeInfo, Range, Ranges
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import SINK, SOURCE

FORMULATIONS = ("tight", "paper")
Edge = tuple[str, str]


@dataclass(frozen=True)
class MilpSettings:
    """How to build the §4.4 MILP."""

    formulation: str = "tight"  # "tight" (this module's docstring) or "paper" (Table 6 as printed)
    symmetry: bool = True  # order interchangeable nodes' first layers (tight formulation)
    compute_cut: bool = True  # L F <= sum_i sum_j j g_i^j (tight formulation)


class Instance:
    """The nodes, the directed connections the MILP may use, and their capacities, scaled.

    Capacities are tokens/s divided by `scale` so that the models' numbers are O(1). `cap` holds the
    transmission bound of every edge (SOURCE, n), (u, v), (n, SINK): min(S_e, T_max of its compute ends),
    which any flow obeys; `raw_cap` holds S_e itself (the paper's formulation), finite."""

    def __init__(self, cluster: ClusterSpec, model: ModelSpec, infos: Sequence[NodeInfo], edges: Iterable[Edge],
                 *, partial: bool, scale: float) -> None:
        self.infos = list(infos)
        self.names = [i.name for i in self.infos]
        self.index = {n: k for k, n in enumerate(self.names)}
        self.info = {i.name: i for i in self.infos}
        self.L = model.num_layers
        self.partial = partial
        self.scale = scale
        tmax = {i.name: max(i.throughput) for i in self.infos}
        finite = sum(tmax.values())  # no flow exceeds the cluster's total one-layer throughput
        known = set(self.names)
        ordered: list[Edge] = [(SOURCE, n) for n in self.names]
        ordered += sorted({(u, v) for u, v in edges if u in known and v in known and u != v},
                          key=lambda e: (self.index[e[0]], self.index[e[1]]))
        ordered += [(n, SINK) for n in self.names]
        self.cap: dict[Edge, float] = {}
        self.raw_cap: dict[Edge, float] = {}
        for u, v in ordered:
            s = link_capacity(cluster, model, u, v)
            bound = min(s, *(tmax[x] for x in (u, v) if x in tmax))
            if bound > 0:
                self.cap[(u, v)] = bound / scale
                self.raw_cap[(u, v)] = min(s, finite) / scale
        self.edges = list(self.cap)
        self.node_edges = [e for e in self.edges if e[0] != SOURCE and e[1] != SINK]
        self.into: dict[str, list[Edge]] = {n: [] for n in self.names}
        self.out_of: dict[str, list[Edge]] = {n: [] for n in self.names}
        for e in self.edges:
            if e[1] in self.into:
                self.into[e[1]].append(e)
            if e[0] in self.out_of:
                self.out_of[e[0]].append(e)
        self.groups = symmetry_groups(self.infos, self.cap)

    def valid(self, e: Edge, ranges: Mapping[str, Range]) -> bool:
        u, v = e
        if u == SOURCE:
            return ranges[v][0] == 0
        if v == SINK:
            return ranges[u][1] == self.L
        return connects(ranges[u], ranges[v], partial=self.partial)

    def canonical(self, ranges: Mapping[str, Range]) -> Ranges:
        """The same placement with interchangeable nodes' ranges sorted, as the symmetry rows require."""
        out = dict(ranges)
        for group in self.groups:
            members = [self.names[i] for i in group]
            for name, r in zip(members, sorted(out[m] for m in members), strict=True):
                out[name] = r
        return out


def symmetry_groups(infos: Sequence[NodeInfo], cap: Mapping[Edge, float]) -> list[list[int]]:
    """Groups (of node indices, in order) of nodes that swapping leaves the MILP unchanged.

    Swapping a and b is an automorphism when they have the same throughputs and, for every other endpoint
    x (the coordinator's two sides included), the same capacity to x and from x (or the same absence of an
    edge), and the edges between them agree. Transpositions that are automorphisms generate an
    equivalence, so comparing with a group's first member is enough."""
    names = [i.name for i in infos]
    ends = [SOURCE, SINK, *names]

    def same(a: int, b: int) -> bool:
        na, nb = names[a], names[b]
        if infos[a].throughput != infos[b].throughput or cap.get((na, nb)) != cap.get((nb, na)):
            return False
        return all(cap.get((na, x)) == cap.get((nb, x)) and cap.get((x, na)) == cap.get((x, nb))
                   for x in ends if x not in (na, nb))

    groups: list[list[int]] = []
    for a in range(len(infos)):
        for group in groups:
            if same(group[0], a):
                group.append(a)
                break
        else:
            groups.append([a])
    return [g for g in groups if len(g) > 1]


# -- a small model builder and a HiGHS run ----------------------------------------------------------------------


@dataclass
class ModelBuilder:
    """Columns and rows, kept as lists until `highs()` passes them to HiGHS in one call."""

    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integral: list[bool] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    starts: list[int] = field(default_factory=lambda: [0])
    index: list[int] = field(default_factory=list)
    value: list[float] = field(default_factory=list)
    row_lower: list[float] = field(default_factory=list)
    row_upper: list[float] = field(default_factory=list)

    def col(self, lo: float, hi: float, integral: bool = False, cost: float = 0.0) -> int:
        self.lower.append(lo)
        self.upper.append(hi)
        self.integral.append(integral)
        self.cost.append(cost)
        return len(self.lower) - 1

    def row(self, terms: Iterable[tuple[int, float]], lower: float, upper: float) -> None:
        for c, coef in terms:
            if coef != 0:
                self.index.append(c)
                self.value.append(coef)
        self.starts.append(len(self.index))
        self.row_lower.append(lower)
        self.row_upper.append(upper)

    @property
    def num_cols(self) -> int:
        return len(self.lower)

    @property
    def num_rows(self) -> int:
        return len(self.row_lower)

    def highs(self, *, threads: int, seed: int) -> highspy.Highs:
        lp = highspy.HighsLp()
        lp.num_col_ = self.num_cols
        lp.num_row_ = self.num_rows
        lp.col_cost_ = np.array(self.cost)
        lp.col_lower_ = np.array(self.lower)
        lp.col_upper_ = np.array(self.upper)
        lp.row_lower_ = np.array(self.row_lower)
        lp.row_upper_ = np.array(self.row_upper)
        lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
        lp.a_matrix_.start_ = np.array(self.starts, dtype=np.int32)
        lp.a_matrix_.index_ = np.array(self.index, dtype=np.int32)
        lp.a_matrix_.value_ = np.array(self.value)
        lp.a_matrix_.num_col_ = self.num_cols
        lp.a_matrix_.num_row_ = self.num_rows
        lp.integrality_ = [highspy.HighsVarType.kInteger if x else highspy.HighsVarType.kContinuous
                           for x in self.integral]
        lp.sense_ = highspy.ObjSense.kMaximize
        h = highspy.Highs()  # type: ignore[no-untyped-call]
        h.setOptionValue("output_flag", False)
        h.setOptionValue("threads", threads)
        h.setOptionValue("random_seed", seed)
        h.passModel(lp)
        return h


@dataclass
class SolveResult:
    status: str  # "optimal", "time_limit", "node_limit", "stopped", "infeasible", "..._no_solution"
    objective: float  # tokens/s of the best integer solution the solver holds (0 if none)
    bound: float  # the solver's dual bound on this (sub)problem, tokens/s
    values: np.ndarray | None  # the best integer solution's column values
    time_s: float
    nodes: int = 0


def run_highs(h: highspy.Highs, *, scale: float, time_limit: float, start: np.ndarray | None = None,
              node_limit: int | None = None, mip_gap: float = 1e-4, objective_stop: float | None = None,
              on_improve: Callable[[float], bool] | None = None) -> SolveResult:
    """One HiGHS run of a maximization whose objective is in units of `scale` tokens/s.

    `objective_stop` (tokens/s): stop once an incumbent reaches it. `on_improve(tokens_per_s)` is called
    for every improving solution; returning True stops the run."""
    h.setOptionValue("time_limit", max(0.01, time_limit))
    h.setOptionValue("mip_rel_gap", mip_gap)
    h.setOptionValue("mip_max_nodes", node_limit if node_limit is not None else 2**31 - 1)
    if start is not None:
        sol = highspy.HighsSolution()
        sol.col_value = list(start)
        sol.value_valid = True
        h.setSolution(sol)
    stop_at = objective_stop / scale if objective_stop is not None else math.inf

    def callback(kind: Any, message: str, data_out: Any, data_in: Any, user: Any) -> None:
        obj = getattr(data_out, "objective_function_value", -math.inf)
        done = obj >= stop_at
        if on_improve is not None and on_improve(obj * scale):
            done = True
        if done:
            data_in.user_interrupt = True

    event = highspy.cb.HighsCallbackType.kCallbackMipImprovingSolution
    h.setCallback(callback, None)
    h.startCallback(event)
    began = time.perf_counter()
    try:
        h.run()
    finally:
        h.stopCallback(event)
    elapsed = time.perf_counter() - began
    info = h.getInfo()
    has_solution = info.primal_solution_status == highspy.SolutionStatus.kSolutionStatusFeasible
    values = np.array(h.getSolution().col_value) if has_solution else None
    objective = info.objective_function_value * scale if has_solution else 0.0
    bound = info.mip_dual_bound * scale if math.isfinite(info.mip_dual_bound) else math.inf
    return SolveResult(_status_name(h.getModelStatus(), has_solution), objective, bound, values, elapsed,
                       int(info.mip_node_count))


def _status_name(status: highspy.HighsModelStatus, has_solution: bool) -> str:
    names = {
        highspy.HighsModelStatus.kOptimal: "optimal",
        highspy.HighsModelStatus.kTimeLimit: "time_limit",
        highspy.HighsModelStatus.kSolutionLimit: "node_limit",
        highspy.HighsModelStatus.kIterationLimit: "iteration_limit",
        highspy.HighsModelStatus.kInterrupt: "stopped",
        highspy.HighsModelStatus.kObjectiveTarget: "stopped",
        highspy.HighsModelStatus.kInfeasible: "infeasible",
    }
    name = names.get(status, status.name.removeprefix("k").lower())
    return name if has_solution or name == "infeasible" else f"{name}_no_solution"


# -- the §4.4 model -------------------------------------------------------------------------------------------


class PlacementMilp:
    """Helix's MILP over an Instance (its nodes each hold at least one layer; its edges may be pruned)."""

    def __init__(self, inst: Instance, settings: MilpSettings | None = None, *, threads: int = 1,
                 seed: int = 0) -> None:
        self.inst = inst
        self.settings = settings = settings or MilpSettings()
        if settings.formulation not in FORMULATIONS:
            raise ValueError(f"unknown formulation {settings.formulation!r}; known: {', '.join(FORMULATIONS)}")
        tight = settings.formulation == "tight"
        L = inst.L
        cap = inst.cap if tight else inst.raw_cap
        m = ModelBuilder()
        self.s = [m.col(0, L - 1, True) for _ in inst.infos]
        self.b = [[m.col(0, 1, True) for _ in range(i.max_layers)] for i in inst.infos]
        self.f: dict[Edge, int] = {}
        self.d: dict[Edge, int] = {}
        for e in inst.edges:
            self.f[e] = m.col(0, cap[e], False, 1.0 if e[0] == SOURCE else 0.0)
            self.d[e] = m.col(0, 1, True)
        self.cond: dict[Edge, tuple[int, int]] = {}
        if inst.partial and not tight:
            self.cond = {e: (m.col(0, 1, True), m.col(0, 1, True)) for e in inst.node_edges}
        use_g = tight and settings.compute_cut
        self.g = [[m.col(0, i.t(j) / inst.scale) for j in range(1, i.max_layers + 1)] for i in inst.infos] \
            if use_g else []

        def end(i: int) -> list[tuple[int, float]]:  # e_i as terms
            return [(self.s[i], 1.0)] + [(c, float(j)) for j, c in enumerate(self.b[i], 1)]

        def neg(terms: list[tuple[int, float]]) -> list[tuple[int, float]]:
            return [(c, -x) for c, x in terms]

        for i, info in enumerate(inst.infos):
            n = info.name
            inflow = [(self.f[e], 1.0) for e in inst.into[n]]
            m.row(((c, 1.0) for c in self.b[i]), 1, 1)  # one layer count
            m.row(end(i), -math.inf, L)  # e_i <= L
            m.row(inflow + [(self.f[e], -1.0) for e in inst.out_of[n]], 0, 0)  # conservation
            capacity = [(c, -info.t(j) / inst.scale) for j, c in enumerate(self.b[i], 1)]
            if use_g:
                m.row(inflow + [(c, -1.0) for c in self.g[i]], 0, 0)
                for j, (g, b) in enumerate(zip(self.g[i], self.b[i], strict=True), 1):
                    m.row([(g, 1.0), (b, -info.t(j) / inst.scale)], -math.inf, 0)
            else:
                m.row(inflow + capacity, -math.inf, 0)
        sources = [e for e in inst.edges if e[0] == SOURCE]
        if use_g:  # L F <= sum_i sum_j j g_i^j
            m.row([(self.f[e], float(L)) for e in sources]
                  + [(g, -float(j)) for gs in self.g for j, g in enumerate(gs, 1)], -math.inf, 0)

        for e in inst.edges:
            u, v = e
            d = self.d[e]
            if u == SOURCE:
                i = inst.index[v]
                big = L - 1 if tight else L
                m.row([(self.s[i], 1.0), (d, float(big))], -math.inf, big)  # s_i <= M (1 - d)
            elif v == SINK:
                i = inst.index[u]
                if tight:  # e_i >= 1 + (L - 1) d
                    m.row([(d, float(L - 1)), *neg(end(i))], -math.inf, -1)
                else:  # L d <= e_i
                    m.row([(d, float(L)), *neg(end(i))], -math.inf, 0)
            else:
                eu, ev = end(inst.index[u]), end(inst.index[v])
                sv = self.s[inst.index[v]]
                if inst.partial and tight:
                    # s_v - e_u <= (L - 2)(1 - d);  e_u - e_v + 1 <= L (1 - d)
                    m.row([(sv, 1.0), (d, float(L - 2)), *neg(eu)], -math.inf, L - 2)
                    m.row([*eu, *neg(ev), (d, float(L))], -math.inf, L - 1)
                elif inst.partial:
                    c1, c2 = self.cond[e]
                    # (L+1)(1 - c1) >= s_v - e_u;  e_v - e_u >= 1 - (L+1)(1 - c2);  d <= c1/2 + c2/2
                    m.row([(sv, 1.0), (c1, float(L + 1)), *neg(eu)], -math.inf, L + 1)
                    m.row([*eu, *neg(ev), (c2, float(L + 1))], -math.inf, L)
                    m.row([(d, 1.0), (c1, -0.5), (c2, -0.5)], -math.inf, 0)
                else:
                    # d = 1 only if e_u = s_v:  e_u - s_v <= M (1 - d);  s_v - e_u <= M' (1 - d)
                    m1, m2 = (L, L - 2) if tight else (L, L)
                    m.row([*eu, (sv, -1.0), (d, float(m1))], -math.inf, m1)
                    m.row([(sv, 1.0), (d, float(m2)), *neg(eu)], -math.inf, m2)
            m.row([(self.f[e], 1.0), (d, -cap[e])], -math.inf, 0)  # f <= d S

        self.symmetry = bool(tight and settings.symmetry)
        if self.symmetry:
            for group in inst.groups:
                for a, b in itertools.pairwise(group):
                    m.row([(self.s[a], 1.0), (self.s[b], -1.0)], -math.inf, 0)
        self.source_cols = [self.f[e] for e in sources]
        self.num_cols = m.num_cols
        self.num_rows = m.num_rows
        self.num_integer = sum(m.integral)
        self.highs = m.highs(threads=threads, seed=seed)

    def limit_objective(self, bound: float) -> None:
        """The objective cut sum_i f_(source, i) <= bound (tokens/s) (Helix §4.5's early-stop bound)."""
        self.highs.addRow(-math.inf, bound / self.inst.scale, len(self.source_cols),
                          np.array(self.source_cols, dtype=np.int32), np.ones(len(self.source_cols)))

    def relaxation_bound(self) -> float:
        """The LP relaxation's optimum (tokens/s): what the solver's bound starts from."""
        lp = self.highs.getLp()
        lp.integrality_ = [highspy.HighsVarType.kContinuous] * self.num_cols
        h = highspy.Highs()  # type: ignore[no-untyped-call]
        h.setOptionValue("output_flag", False)
        h.passModel(lp)
        h.run()
        return float(h.getInfo().objective_function_value) * self.inst.scale

    def solution_of(self, ranges: Mapping[str, Range], flows: Mapping[Edge, float]) -> np.ndarray:
        """The column vector of a placement and a flow on it (tokens/s; this model's edges only)."""
        inst = self.inst
        if self.symmetry and dict(ranges) != inst.canonical(ranges):
            raise ValueError("a warm start must be canonical (Instance.canonical) for the symmetry rows")
        x = np.zeros(self.num_cols)
        inflow = dict.fromkeys(inst.names, 0.0)
        for i, n in enumerate(inst.names):
            first, last = ranges[n]
            x[self.s[i]] = first
            x[self.b[i][last - first - 1]] = 1.0
        for e in inst.edges:
            u, v = e
            if e in self.cond:
                c1, c2 = self.cond[e]
                x[c1] = float(ranges[v][0] <= ranges[u][1])
                x[c2] = float(ranges[u][1] < ranges[v][1])
            if inst.valid(e, ranges):
                x[self.d[e]] = 1.0
                flow = min(flows.get(e, 0.0) / inst.scale, inst.cap[e])
                x[self.f[e]] = flow
                if v in inflow:
                    inflow[v] += flow
        for i, n in enumerate(inst.names):
            if self.g:
                first, last = ranges[n]
                x[self.g[i][last - first - 1]] = inflow[n]
        return x

    def ranges_of(self, x: Sequence[float] | np.ndarray) -> Ranges:
        out: Ranges = {}
        for i, n in enumerate(self.inst.names):
            first = round(x[self.s[i]])
            layers = 1 + max(range(len(self.b[i])), key=lambda j: x[self.b[i][j]])
            out[n] = (first, min(first + layers, self.inst.L))
        return out

    def solve(self, *, time_limit: float, start: np.ndarray | None = None, node_limit: int | None = None,
              mip_gap: float = 1e-4, objective_stop: float | None = None,
              on_improve: Callable[[float], bool] | None = None) -> tuple[SolveResult, Ranges | None]:
        result = run_highs(self.highs, scale=self.inst.scale, time_limit=time_limit, start=start,
                           node_limit=node_limit, mip_gap=mip_gap, objective_stop=objective_stop,
                           on_improve=on_improve)
        return result, (self.ranges_of(result.values) if result.values is not None else None)
