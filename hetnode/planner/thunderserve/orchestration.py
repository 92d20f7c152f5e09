"""Which prefill replica takes a request, and which decode replica it goes to next: §3.3's TSTP as an LP.

The paper's problem, max sum_ij X_i Y_ij D_ij over sum_i X_i = 1 and sum_j Y_ij = 1, has no capacities: its
optimum sends every request to the single best pair, which that pair could not serve. Here, with
Z_ij = X_i Y_ij the share of all requests routed through pair (i, j) and lambda the arrival rate:

    maximize    sum_ij (D_ij + eps) Z_ij
    subject to  sum_ij Z_ij <= 1
                lambda sum_j Z_ij <= u mu_i       for every prefill replica i (prompts/s it sustains)
                lambda sum_i r_ij Z_ij <= u nu_j  for every decode replica j (requests/s it sustains)
                lambda sum_ij b_ijl Z_ij <= u B_l  for every link l that KV hand-offs cross
                Z_ij >= 0

nu_j is what replica j's KV sustains when a request holds it for its decode alone (max_batch / (output_len x
TPOT)); r_ij >= 1 is how much longer a request through pair (i, j) holds it (`slo.decode_residency`): the
scheduler books the decode KV when it admits the request, so it is held through the prefill on i and the
hand-off too. By Little's law replica j's KV then holds lambda sum_i Z_ij R_ij requests, which the row bounds by
u max_batch_j (divided through by the decode time). Without r, a long prefill pipeline's decode replica was
planned at twice what its KV served (docs/reproducing-thunderserve.md). A pair with no way to hand its KV over
(r infinite) takes nothing.

b_ijl is the bytes one request's KV puts on link l when it goes from prefill replica i to decode replica j (at
the codec that link uses) and B_l the link's bandwidth (bytes/s). Without these rows each pair's transfer is
priced alone, in D_ij, as if its links were its own: at fp16 on 5 Gb/s links the LP then sent most requests
through the few pairs whose single transfer looked cheapest, and those links queued for tens of seconds
(docs/reproducing-thunderserve.md). A link is a directed GPU pair as the cluster file states it (`lower.link_loads`);
a host's NIC shared by several GPU pairs is not a row, as the simulator queues each GPU pair apart.

u (`utilization`, below 1) keeps every queue stable, links' included. A share the replicas and links cannot take is
left unrouted and counts as missing its SLO, so the LP is always feasible and sum_ij D_ij Z_ij is the expected
attainment of all requests. eps (far below any D) makes the LP route what it can even where no pair attains
anything, so that X and Y are defined. X_i = sum_j Z_ij / sum Z and Y_ij = Z_ij / sum_j Z_ij; a prefill replica the
LP leaves idle sends to its best pair. D is given, estimated at fixed loads (slo.py; the caller, `lower.LowerLevel`,
estimates it at loads proportional to capacity and again at the loads of the routing this returns), which is
what keeps this a linear program; Z is bilinear in X and Y, and any Z gives back X and Y, so the LP over Z is the
TSTP with capacities added.
Solved with HiGHS (the simplex, a few milliseconds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import highspy
import numpy as np

EPS = 1e-6


@dataclass(frozen=True)
class LinkLoad:
    """One directed link that KV hand-offs cross: its bandwidth, and the bytes per request of each pair using it."""

    bytes_per_s: float
    pairs: tuple[tuple[int, int, float], ...]  # (i, j, bytes one request through pair (i, j) sends over it)


@dataclass(frozen=True)
class Routing:
    prefill_share: tuple[float, ...]  # X_i
    decode_share: tuple[tuple[float, ...], ...]  # Y_ij
    attainment: float  # sum_ij D_ij Z_ij: the expected share of all requests within their SLOs
    routed: float  # sum_ij Z_ij: the share of requests the replicas can take


class Solver:
    """One HiGHS instance for many LPs: making one costs about as much as solving a small LP. Each LP starts
    from a cleared model (no warm start), so the answer is the one a fresh instance gives."""

    def __init__(self) -> None:
        self._highs: highspy.Highs | None = None

    def fresh(self) -> highspy.Highs:
        if self._highs is None:
            self._highs = highspy.Highs()  # type: ignore[no-untyped-call]
            self._highs.setOptionValue("output_flag", False)
            self._highs.setOptionValue("threads", 1)
        else:
            self._highs.clearModel()
        return self._highs


def orchestrate(d: Sequence[Sequence[float]], prefill_caps: Sequence[float], decode_caps: Sequence[float],
                rate: float, utilization: float, solver: Solver | None = None,
                links: Sequence[LinkLoad] = (), residency: Sequence[Sequence[float]] | None = None,
                balance: bool = True) -> Routing:
    """The LP of the module docstring; `residency` is r_ij (None: every r_ij is 1, the decode alone). With
    `balance`, a second LP picks, among the routings that attain the same, the one with the most headroom
    (`_balanced`)."""
    m, n = len(prefill_caps), len(decode_caps)
    r = [[1.0] * n for _ in range(m)] if residency is None else [list(row) for row in residency]
    if len(r) != m or any(len(row) != n or not all(v >= 1.0 for v in row) for row in r):
        raise ValueError(f"residency must be {m} x {n} ratios >= 1, not {residency}")
    if m == 0 or n == 0:
        # One phase has no replica: nothing is served (a deployment the search moves away from).
        return Routing((1.0 / m,) * m if m else (), tuple(() for _ in range(m)), 0.0, 0.0)
    h = (solver or Solver()).fresh()
    k = m * n
    cost = np.array([d[i][j] + EPS for i in range(m) for j in range(n)], dtype=float)
    col_upper = np.array([0.0 if math.isinf(r[i][j]) else np.inf for i in range(m) for j in range(n)])
    rows: list[tuple[list[int], list[float], float]] = [(list(range(k)), [1.0] * k, 1.0)]
    rows += [([i * n + j for j in range(n)], [1.0] * n, utilization * prefill_caps[i] / rate) for i in range(m)]
    for j in range(n):
        finite = [i for i in range(m) if math.isfinite(r[i][j])]
        rows.append(([i * n + j for i in finite], [r[i][j] for i in finite], utilization * decode_caps[j] / rate))
    for link in links:
        # Seconds of the link each routed share takes per second of arrivals: sum of those <= u.
        per_pair: dict[int, float] = {}
        for i, j, nbytes in link.pairs:
            per_pair[i * n + j] = per_pair.get(i * n + j, 0.0) + rate * nbytes / link.bytes_per_s
        cols = sorted(c for c, v in per_pair.items() if v > 0)
        if cols:
            rows.append((cols, [per_pair[c] for c in cols], utilization))
    z = _solve(h, cost, col_upper, [(cols, coefficients, -np.inf, bound) for cols, coefficients, bound in rows],
               highspy.ObjSense.kMaximize).reshape(m, n)
    if not balance:
        return routing_of(z, d)
    kinds = [PREFILL_ROW] * m + [DECODE_ROW] * n + [LINK_ROW] * (len(rows) - 1 - m - n)
    shares = _balanced(h, rows, kinds, cost, col_upper, float(cost @ z.reshape(k)), float(z.sum()))
    if shares is None:
        # (numerically infeasible at HiGHS's tolerances: the first LP's routing, unbalanced)
        return routing_of(z, d)
    return routing_of(shares.reshape(m, n), d)


# How much estimated attainment (a share of all requests) the balanced routing may give up against the best:
# D is a mean over `first_token.SAMPLE` requests, good to about this much, and it is estimated at loads in
# proportion to capacity. Closer to the best, the routing goes back to the vertex that fills the pairs D happens
# to rate highest to u x capacity, where queues D never saw form (measured on coding, issue 14: two one-stage
# prefill replicas at 0.9 of their rate and four others idle, TTFT 5 s at a load the planner scored 73%).
BALANCE_SLACK = 0.02
PREFILL_ROW, DECODE_ROW, LINK_ROW = ROW_KINDS = (0, 1, 2)  # the kinds of capacity row `_balanced` balances apart
TIE_WEIGHT = 1e-3  # the balanced LP's weight on attainment beside the busiest row's load (far below 1: t first)


def _balanced(h: highspy.Highs, rows: list[tuple[list[int], list[float], float]], kinds: list[int],
              cost: np.ndarray, col_upper: np.ndarray, best: float, routed: float) -> np.ndarray | None:
    """Among the routings within BALANCE_SLACK of the best objective that route as many requests (`routed`), the
    one whose busiest prefill replica, busiest decode replica and busiest link are least loaded against their
    bounds: min t_prefill + t_decode + t_link over every capacity row's load <= t_(its kind) x its bound. (One t
    for all rows left the decode replicas' split arbitrary wherever a prefill replica was the busiest row: measured
    sending 97% of the requests to one of two equal decode replicas.)

    D is estimated at loads in proportion to capacity (the module docstring), so wherever several routings attain
    the same or nearly (D is 1 for every pair of a deployment with room to spare, the common case below
    saturation), the simplex's vertex is arbitrary: it measured filling the small decode replicas to u x capacity
    and leaving the largest idle, whose KV queues then held hand-offs for half a minute
    (docs/reproducing-thunderserve.md). The balanced routing is the one D was estimated for. None when HiGHS finds
    no optimum (a tie-break is not worth failing a plan for)."""
    k = len(cost)
    total_cols, total_coefficients, total_bound = rows[0]
    lp_rows = [(total_cols, total_coefficients, -np.inf, total_bound)]
    for (cols, coefficients, bound), kind in zip(rows[1:], kinds, strict=True):
        # capacity rows: load <= bound, and load - t_kind bound <= 0
        lp_rows.append((cols, coefficients, -np.inf, bound))
        lp_rows.append(([*cols, k + kind], [*coefficients, -bound], -np.inf, 0.0))
    # The objective kept to within the slack of the best, scaled to the largest cost: with every D 0 the costs are
    # EPS alone, which HiGHS's tolerances would not tell apart.
    scale = float(cost.max())
    lp_rows.append((list(range(k)), list(cost / scale), (best - BALANCE_SLACK) / scale - 1e-9, np.inf))
    lp_rows.append((list(range(k)), [1.0] * k, routed - 1e-9, np.inf))
    h.clearModel()
    # min the t's, and among the routings as balanced the one that attains most (a tie is common: a kind's busiest
    # row may be one no share can relieve, so that many routings reach it)
    objective = np.append(-TIE_WEIGHT * cost / scale, np.ones(len(ROW_KINDS)))
    shares = _solve(h, objective, np.append(col_upper, np.full(len(ROW_KINDS), np.inf)), lp_rows,
                    highspy.ObjSense.kMinimize)[:k]
    if h.getModelStatus() != highspy.HighsModelStatus.kOptimal:
        return None
    total = float(shares.sum())
    return shares / total if total > 1.0 else shares  # (HiGHS's tolerance can route 1 + 1e-8 of the requests)


def _solve(h: highspy.Highs, cost: np.ndarray, col_upper: np.ndarray,
           rows: list[tuple[list[int], list[float], float, float]], sense: highspy.ObjSense) -> np.ndarray:
    """One LP over columns >= 0 (bounded above by `col_upper`) with rows lo <= sum coefficients x cols <= hi;
    the solution, clipped at 0."""
    lp = highspy.HighsLp()
    lp.num_col_ = len(cost)
    lp.col_cost_ = cost
    lp.col_lower_ = np.zeros(len(cost))
    lp.col_upper_ = col_upper
    starts, index, values = [0], [], []
    for cols, coefficients, _, _ in rows:
        index += cols
        values += coefficients
        starts.append(len(index))
    lp.num_row_ = len(rows)
    lp.row_lower_ = np.array([lo for _, _, lo, _ in rows], dtype=float)
    lp.row_upper_ = np.array([hi for _, _, _, hi in rows], dtype=float)
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.array(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.array(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.array(values, dtype=float)
    lp.a_matrix_.num_col_ = len(cost)
    lp.a_matrix_.num_row_ = len(rows)
    lp.sense_ = sense
    h.passModel(lp)
    h.run()
    solution: np.ndarray = np.maximum(np.array(h.getSolution().col_value[:len(cost)], dtype=float), 0.0)
    return solution


def pair_shares(routing: Routing) -> np.ndarray:
    """Z back from a routing: the share of all requests through each pair (X_i Y_ij of what it routes)."""
    return np.array([[routing.routed * x * y for y in row]
                     for x, row in zip(routing.prefill_share, routing.decode_share, strict=True)], dtype=float)


def routing_of(z: np.ndarray, d: Sequence[Sequence[float]]) -> Routing:
    """X, Y and the attainment of a routing Z (shares of all requests per pair)."""
    m, n = z.shape
    total = float(z.sum())
    rows = z.sum(axis=1)
    x = tuple(float(r / total) if total > 0 else 1.0 / m for r in rows)
    y = []
    for i in range(m):
        if rows[i] > 0:
            y.append(tuple(float(v / rows[i]) for v in z[i]))
        else:
            best = max(range(n), key=lambda j: (d[i][j], -j))
            y.append(tuple(1.0 if j == best else 0.0 for j in range(n)))
    value = float(sum(d[i][j] * z[i, j] for i in range(m) for j in range(n)))
    return Routing(prefill_share=x, decode_share=tuple(y), attainment=value, routed=total)
