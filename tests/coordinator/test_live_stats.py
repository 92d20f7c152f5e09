"""LiveStats: outcomes, TTFT/TPOT percentiles, the sliding window and its buckets, under a fake clock."""

from __future__ import annotations

import pytest

from hetnode.coordinator.live_stats import LiveStats, percentile
from hetnode.coordinator.openai_api import RequestRecord


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def record(status: int = 200, tokens: int = 5, finish: str | None = "stop", gone: bool = False,
           ttft: float | None = 0.2, duration: float = 1.0) -> RequestRecord:
    return RequestRecord("completions", status, True, 10, tokens, finish, gone, ttft, duration)


def test_outcomes_and_tpot() -> None:
    # The one classification /metrics and the dashboard both count by (RequestRecord.outcome).
    assert record().outcome == "completed"
    assert record(status=400, tokens=0, finish=None, ttft=None).outcome == "client_error"
    assert record(status=503, finish=None).outcome == "server_error"
    assert record(finish=None).outcome == "server_error"  # a 200 stream that ended with an error event
    assert record(gone=True, finish=None).outcome == "cancelled"
    # 5 tokens in 1 s with the first at 0.2 s: the other 4 took 0.8 s.
    assert record().tpot_s == pytest.approx(0.2)
    assert record(tokens=1).tpot_s is None and record(ttft=None).tpot_s is None


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 95) == 95.0
    assert percentile([7.0], 0) == 7.0


def test_window_rate_and_buckets() -> None:
    clock = FakeClock()
    stats = LiveStats(clock, window_s=10, buckets=5)
    clock.now += 10  # up for a whole window
    for ttft in (0.1, 0.3):
        stats.observe_request(record(ttft=ttft, duration=ttft + 0.4))  # 4 more tokens in 0.4 s each
    clock.now += 3
    stats.observe_request(record(status=429, tokens=0, finish=None, ttft=None, duration=0.0))
    s = stats.summary()
    assert s["requests"] == 3 and s["rate"] == pytest.approx(0.3)
    assert s["output_tokens_per_s"] == pytest.approx(1.0)
    assert s["outcomes"] == {"completed": 2, "cancelled": 0, "client_error": 1, "server_error": 0}
    assert s["ttft_s"] == {"p50": 0.1, "p95": 0.3}
    assert s["tpot_s"]["p50"] == pytest.approx(0.1)
    series = s["series"]
    assert isinstance(series, list) and len(series) == 5
    # Buckets of 2 s, oldest first: the two at t-3 s sit in the fourth, the refusal at t in the last.
    assert [b["requests"] for b in series] == [0, 0, 0, 2, 1]
    assert series[3]["ttft_s"] == pytest.approx(0.2) and series[4]["failed"] == 1
    clock.now += 8  # the first two leave the window; the totals keep them
    s = stats.summary()
    assert s["requests"] == 1 and s["ttft_s"] == {"p50": None, "p95": None}
    assert s["totals"] == {"completed": 2, "cancelled": 0, "client_error": 1, "server_error": 0}


def test_young_coordinator_rates_over_its_uptime_and_bad_settings_are_refused() -> None:
    clock = FakeClock()
    stats = LiveStats(clock, window_s=60)
    clock.now += 2
    stats.observe_request(record())
    assert stats.summary()["rate"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="window_s"):
        LiveStats(clock, window_s=0)
    with pytest.raises(ValueError, match="buckets"):
        LiveStats(clock, buckets=0)
