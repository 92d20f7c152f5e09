"""The requests the coordinator answered, as the dashboard shows them: rate, outcomes, TTFT and TPOT over a
sliding window, and the same per bucket of that window for its charts.

Fed by the OpenAI routes' per-request records (it is an `openai_api.ApiMetrics`), so it sees exactly what the
clients saw: TTFT from the request's arrival to its first token, TPOT as the rest of its time over the rest of
its tokens. It keeps numbers only, never text. Pure: time comes from the injected clock, so tests drive it with
a fake one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from hetnode.coordinator.openai_api import OUTCOMES, Outcome, RequestRecord


@dataclass(frozen=True, slots=True)
class _Entry:
    at: float
    outcome: Outcome
    ttft_s: float | None
    tpot_s: float | None
    output_tokens: int


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]) of values; None when there are none."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


class LiveStats:
    def __init__(self, clock: Callable[[], float], *, window_s: float = 60.0, buckets: int = 30,
                 max_entries: int = 100_000) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, not {window_s}")
        if buckets < 1:
            raise ValueError(f"buckets must be >= 1, not {buckets}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, not {max_entries}")
        self.clock = clock
        self.window_s = window_s
        self.buckets = buckets
        # Bounded also by count: a flood of refusals must not grow memory before the window trims it.
        self._entries: deque[_Entry] = deque(maxlen=max_entries)
        self._started = clock()
        self.totals: dict[Outcome, int] = dict.fromkeys(OUTCOMES, 0)

    def observe_request(self, record: RequestRecord) -> None:
        self.totals[record.outcome] += 1
        self._entries.append(_Entry(self.clock(), record.outcome, record.time_to_first_token_s, record.tpot_s,
                                    record.completion_tokens))

    def _trim(self, now: float) -> None:
        while self._entries and self._entries[0].at <= now - self.window_s:
            self._entries.popleft()

    def summary(self) -> dict[str, object]:
        """The window's numbers (times in seconds, rates per second) and its buckets, oldest first."""
        now = self.clock()
        self._trim(now)
        entries = list(self._entries)
        # A coordinator up for less than a window has seen requests for less than a window.
        span = min(self.window_s, now - self._started)
        ttfts = [e.ttft_s for e in entries if e.ttft_s is not None]
        tpots = [e.tpot_s for e in entries if e.tpot_s is not None]
        tokens = sum(e.output_tokens for e in entries)
        width = self.window_s / self.buckets
        series = []
        for i in range(self.buckets):
            lo = now - self.window_s + i * width
            inside = [e for e in entries if lo < e.at <= lo + width]
            b_ttft = [e.ttft_s for e in inside if e.ttft_s is not None]
            b_tpot = [e.tpot_s for e in inside if e.tpot_s is not None]
            series.append({
                "ago_s": round(now - lo - width, 3),
                "requests": len(inside),
                "failed": sum(1 for e in inside if e.outcome != "completed"),
                "output_tokens": sum(e.output_tokens for e in inside),
                "ttft_s": sum(b_ttft) / len(b_ttft) if b_ttft else None,
                "tpot_s": sum(b_tpot) / len(b_tpot) if b_tpot else None,
            })
        return {
            "window_s": self.window_s,
            "bucket_s": width,
            "requests": len(entries),
            "rate": len(entries) / span if span > 0 else 0.0,
            "output_tokens_per_s": tokens / span if span > 0 else 0.0,
            "outcomes": {o: sum(1 for e in entries if e.outcome == o) for o in OUTCOMES},
            "totals": dict(self.totals),
            "ttft_s": {"p50": percentile(ttfts, 50), "p95": percentile(ttfts, 95)},
            "tpot_s": {"p50": percentile(tpots, 50), "p95": percentile(tpots, 95)},
            "series": series,
        }
