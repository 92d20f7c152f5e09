"""The coordinator's view of the workload: a sliding window of lengths and arrivals, and when it has shifted."""

from __future__ import annotations

import pytest

from hetnode.policy.workload_monitor import WorkloadMonitor


def feed(m: WorkloadMonitor, start: float, n: int, gap: float, prompt: int, output: int) -> float:
    t = start
    for _ in range(n):
        m.arrived(t, prompt)
        m.finished(t + 0.5, output)
        t += gap
    return t


def test_the_window_reports_its_mix_and_forgets_what_is_older() -> None:
    m = WorkloadMonitor((750, 240), window_s=60, min_requests=10)
    t = feed(m, 0.0, 60, 1.0, 800, 200)  # one a second for a minute
    mix = m.mix(t)
    assert mix.arrivals == 60 and mix.rate == pytest.approx(1.0, rel=0.05)
    assert (mix.mean_input, mix.mean_output) == (800, 200)
    t = feed(m, t, 120, 0.5, 2000, 50)  # then two a second of another kind, for a minute
    mix = m.mix(t)
    assert mix.mean_input == pytest.approx(2000) and mix.mean_output == pytest.approx(50)
    assert mix.rate == pytest.approx(2.0, rel=0.05)
    assert m.spread(t) == (0.0, 0.0)  # every length the same


def test_the_window_reports_how_much_lengths_spread() -> None:
    m = WorkloadMonitor((750, 240), window_s=60, min_requests=10)
    assert m.spread(0.0) == (0.0, 0.0)
    t = feed(m, 0.0, 20, 1.0, 100, 10)
    t = feed(m, t, 20, 1.0, 300, 30)
    assert m.spread(t) == pytest.approx((0.5, 0.5))  # sd 100 over mean 200
    assert m.spread(t + 200) == (0.0, 0.0)  # the window forgets


def test_a_shift_is_reported_against_the_baseline_until_rebased() -> None:
    m = WorkloadMonitor((750, 240), window_s=60, shift=0.5, min_requests=20)
    t = feed(m, 0.0, 10, 1.0, 3000, 240)
    assert m.shifted(t) == ""  # too few to say
    t += 60  # (those leave the window)
    t = feed(m, t, 40, 1.0, 1000, 300)  # within 50% of both
    assert m.shifted(t) == ""
    t = feed(m, t, 60, 1.0, 3000, 100)  # prompts four times as long, outputs under half
    why = m.shifted(t)
    assert "mean prompt length 750 -> 3000" in why and "mean output length 240 -> 100" in why
    assert m.rebase(t) == (3000, 100)
    assert m.shifted(t) == ""
    t = feed(m, t, 30, 1.0, 500, 100)  # half a window later the mix has moved again, but it is still passing
    assert m.shifted(t) == ""
    t = feed(m, t, 40, 1.0, 500, 100)  # a window after the rebase, it is judged again
    assert "mean prompt length 3000 -> 500" in m.shifted(t)


def test_bad_settings_are_refused() -> None:
    for kwargs in ({"window_s": 0}, {"shift": 0}, {"min_requests": 0}):
        with pytest.raises(ValueError):
            WorkloadMonitor((750, 240), **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="baseline"):
        WorkloadMonitor((0, 240))


def test_a_shift_of_the_arrival_rate_is_judged_against_the_planned_rate() -> None:
    m = WorkloadMonitor((750, 240), window_s=60, shift=0.5, min_requests=20, rate=1.0)
    t = feed(m, 0.0, 70, 1.0, 750, 240)  # the lengths and the rate it was planned for
    assert m.shifted(t) == ""
    t = feed(m, t, 150, 0.4, 750, 240)  # 2.5 a second, same lengths
    assert m.shifted(t).startswith("arrival rate 1.00 -> 2.4")
    assert m.rebase(t) == (750, 240) and m.rate == pytest.approx(2.5, rel=0.05)
    t = feed(m, t, 150, 0.4, 750, 240)  # a window later, steady at the new rate
    assert m.shifted(t) == ""
    t = feed(m, t, 60, 1.0, 750, 240)  # back to one a second, for a window
    assert m.shifted(t).startswith("arrival rate 2.") and m.mix(t).rate == pytest.approx(1.0, rel=0.05)


def test_a_plan_made_for_no_rate_has_its_rate_reported_not_judged() -> None:
    m = WorkloadMonitor((750, 240), window_s=60, shift=0.5, min_requests=20)
    t = feed(m, 0.0, 300, 0.2, 750, 240)  # five a second
    assert m.mix(t).rate == pytest.approx(5.0, rel=0.05) and m.shifted(t) == ""
    m.planned_at(1.0)  # the planner states the rate its plan was made for
    assert m.shifted(t).startswith("arrival rate 1.00 -> 4.9")
    m.planned_at(None)
    assert m.shifted(t) == ""
    with pytest.raises(ValueError, match="rate"):
        m.planned_at(0.0)
