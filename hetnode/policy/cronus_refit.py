"""Cronus's predictors refitted as a pair serves: Eqs. 2 and 3 start from the fits on the nodes' profiles at join
time (`planner/cronus_fit.py`) and follow the times the pair is seen to take.

What the executor sees of a request split at L_p (both executors see the same: the coordinator from the
`HandedOver` message and the first token, the simulator at the same events):

- the PPI's partial prefill: from when the PPI could start it (its dispatch, or the end of the PPI's previous
  partial prefill, whichever is later: the PPI prefills one request at a time) to the hand-over. Eq. 2's
  features are (L_p, 1).
- the CPI's chunked prefill of the rest: from the hand-over to the first token. Eq. 1 sums N iterations whose
  times Eq. 3 gives, so the rest's time is linear in Eq. 3's coefficients with the features
  (N (L_first + L_in) / 2, N sum L_d, N), from the CPI state the balancer read at dispatch (`chunked_features`,
  the balancer's own arithmetic).

Each refit is a least-squares fit over the latest `window` observations, pulled towards the join-time fit as if
it were `prior` observations along each feature (ridge towards the prior, each feature scaled by its mean
square): a handful of noisy times moves the predictor a little, a steady stream moves it to what the node does;
a feature the observations never exercise (no decodes yet) keeps its join-time coefficient. Coefficients are
kept >= 0, as fitted ones are (the balancer's fast path relies on it).

Pure: the executor passes the times.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from hetnode.policy.cronus import ChunkedIteration, CpiState, LinearPrefill

REFIT_WINDOW = 64  # the coordinator's window: the latest 64 split requests of a pair


def chunked_features(prompt: int, tokens: int, state: CpiState) -> tuple[float, float, float]:
    """The features of the CPI's time for the last `prompt - tokens` tokens: its Eq. 1 time is
    k_ctxp x[0] + k_ctxd x[1] + b x[2] (`CronusBalancer.split`'s T_c, term by term)."""
    per = state.max_batch_tokens - state.decodes
    rest = prompt - tokens
    if rest <= 0 or per < 1:
        return 0.0, 0.0, 0.0
    n = -(-rest // per)
    first = tokens + min(rest, per)
    return n * (first + prompt) / 2, float(n * state.decode_context), float(n)


def _ridge(rows: Sequence[tuple[Sequence[float], float]], prior: Sequence[float], weight: float) -> list[float]:
    """argmin_c sum (x.c - y)^2 + weight sum_j s_j (c_j - prior_j)^2, s_j the mean of x_j^2 (1 where it is 0)."""
    n = len(prior)
    scale = [sum(x[j] * x[j] for x, _ in rows) / len(rows) or 1.0 for j in range(n)]
    a = [[sum(x[i] * x[j] for x, _ in rows) + (weight * scale[i] if i == j else 0.0) for j in range(n)]
         for i in range(n)]
    b = [sum(x[i] * y for x, y in rows) + weight * scale[i] * prior[i] for i in range(n)]
    c = _solve(a, b)
    if c is None:
        return list(prior)
    return [max(0.0, v) if math.isfinite(v) else p for v, p in zip(c, prior, strict=True)]


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """a c = b by Gaussian elimination with partial pivoting (a is at most 3 x 3 here); None if singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if m[pivot][col] == 0:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for k in range(col, n + 1):
                m[r][k] -= f * m[col][k]
    c = [0.0] * n
    for i in range(n - 1, -1, -1):
        c[i] = (m[i][n] - sum(m[i][k] * c[k] for k in range(i + 1, n))) / m[i][i]
    return c


@dataclass
class PredictorRefit:
    ppi: LinearPrefill  # the join-time fits: what each refit is pulled towards
    cpi: ChunkedIteration
    window: int = 64  # the latest observations a fit uses
    prior: float = 4.0  # the join-time fit weighs as this many observations
    partial: deque[tuple[tuple[float, float], float]] = field(default_factory=deque)
    chunked: deque[tuple[tuple[float, float, float], float]] = field(default_factory=deque)

    def __post_init__(self) -> None:
        if self.window < 1 or not self.prior > 0:
            raise ValueError(f"window ({self.window}) must be >= 1 and prior ({self.prior}) > 0")

    def observe_partial(self, tokens: int, seconds: float) -> LinearPrefill:
        """The PPI prefilled `tokens` in `seconds`: Eq. 2 refitted."""
        if tokens > 0 and seconds >= 0 and math.isfinite(seconds):
            self.partial.append(((float(tokens), 1.0), seconds))
            while len(self.partial) > self.window:
                self.partial.popleft()
        if not self.partial:
            return self.ppi
        k, b = _ridge(self.partial, (self.ppi.k, self.ppi.b), self.prior)
        return LinearPrefill(k, b)

    def observe_chunked(self, prompt: int, tokens: int, state: CpiState, seconds: float) -> ChunkedIteration:
        """The CPI finished the last `prompt - tokens` tokens of a prompt in `seconds`, from the state the
        balancer read at dispatch: Eq. 3 refitted."""
        features = chunked_features(prompt, tokens, state)
        if features[2] > 0 and seconds >= 0 and math.isfinite(seconds):
            self.chunked.append((features, seconds))
            while len(self.chunked) > self.window:
                self.chunked.popleft()
        if not self.chunked:
            return self.cpi
        kp, kd, b = _ridge(self.chunked, (self.cpi.k_ctxp, self.cpi.k_ctxd, self.cpi.b), self.prior)
        return ChunkedIteration(kp, kd, b)
