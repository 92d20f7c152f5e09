"""Algorithm 2's prefill-time predictor: seconds to prefill a prompt of n tokens, fitted on a profile.

EcoServe predicts "by profiling sequences of various lengths" (§3.4). A prefill's cost is linear in its tokens
(the weights' FLOPs) plus quadratic in them (attention over the prefix), plus a fixed part (launches, TP's
latency), so the predictor is the least-squares quadratic a + b n + c n^2 through the measured points; with
fewer than three distinct lengths it falls back to a line, and with one point to a proportion.

Pure: points in (a node's measured profile, or a simulated instance's cost model), a callable out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

PROFILE_LENGTHS = (16, 64, 128, 256, 512, 1024, 2048, 4096)  # the lengths a profile measures


@dataclass(frozen=True, slots=True)
class PrefillPredictor:
    a: float
    b: float
    c: float = 0.0

    def __call__(self, tokens: int) -> float:
        return max(0.0, self.a + self.b * tokens + self.c * tokens * tokens)

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> PrefillPredictor:
        """The least-squares fit through (tokens, seconds) points."""
        if not points or any(n < 1 or not t >= 0 for n, t in points):
            raise ValueError(f"need (tokens >= 1, seconds >= 0) points, not {list(points)[:4]}")
        n = np.array([p[0] for p in points], dtype=float)
        t = np.array([p[1] for p in points], dtype=float)
        distinct = len(set(n.tolist()))
        if distinct == 1:
            return cls(0.0, float(t.mean() / n[0]))
        degree = 2 if distinct >= 3 else 1
        coeffs = np.polyfit(n, t, degree)[::-1]
        return cls(float(coeffs[0]), float(coeffs[1]), float(coeffs[2]) if degree == 2 else 0.0)
