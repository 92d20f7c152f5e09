"""Algorithm 2's prefill-time predictor: seconds to prefill a prompt of n tokens, fitted on a profile.

EcoServe predicts "by profiling sequences of various lengths" (§3.4). The predictor interpolates linearly
between the profiled lengths and extends the last segment beyond them (prefill grows a little faster than
linearly, so the extension errs low by the attention term's growth); below the shortest it keeps the shortest's
time, since a short prompt's step costs at least a pass over the weights.

Pure: points in (a node's measured profile, or a simulated instance's cost model), a callable out.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

PROFILE_LENGTHS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)  # profiled


@dataclass(frozen=True, slots=True)
class PrefillPredictor:
    points: tuple[tuple[int, float], ...]  # (tokens, seconds), tokens rising and distinct

    def __call__(self, tokens: int) -> float:
        pts = self.points
        if tokens <= pts[0][0] or len(pts) == 1:
            return pts[0][1] if len(pts) > 1 or tokens <= pts[0][0] else pts[0][1] * tokens / pts[0][0]
        k = bisect.bisect_left([n for n, _ in pts], tokens)
        (n0, t0), (n1, t1) = pts[min(k, len(pts) - 1) - 1], pts[min(k, len(pts) - 1)]
        return max(0.0, t0 + (t1 - t0) * (tokens - n0) / (n1 - n0))

    @classmethod
    def fit(cls, points: Sequence[tuple[int, float]]) -> PrefillPredictor:
        """The predictor through (tokens, seconds) points (repeated lengths averaged)."""
        if not points or any(n < 1 or not t >= 0 for n, t in points):
            raise ValueError(f"need (tokens >= 1, seconds >= 0) points, not {list(points)[:4]}")
        by_len: dict[int, list[float]] = {}
        for n, t in points:
            by_len.setdefault(n, []).append(t)
        return cls(tuple((n, sum(ts) / len(ts)) for n, ts in sorted(by_len.items())))
