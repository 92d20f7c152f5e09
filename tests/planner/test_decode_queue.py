"""A decode replica's KV as requests queue for it, first come first served (planner/thunderserve/decode_queue.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetnode.planner.thunderserve.decode_queue import room_at, sustained


def arr(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=float)


def test_with_room_to_spare_nobody_waits() -> None:
    arrivals = arr(0.0, 0.5, 1.0, 1.5)
    assert room_at(arrivals, arr(10, 10, 10, 10), arr(5, 5, 5, 5), 1000.0, 8).tolist() == arrivals.tolist()


def test_a_request_that_does_not_fit_waits_and_holds_up_the_ones_behind_it() -> None:
    # 100 tokens of KV: the first holds 60 until 10 s; the second needs 60 and waits for it; the third needs 10 and
    # would fit at once, but room is given in order, so it waits behind the second.
    start = room_at(arr(0.0, 1.0, 2.0), arr(60, 60, 10), arr(10, 10, 10), 100.0, 8)
    assert start.tolist() == [0.0, 10.0, 10.0]


def test_at_most_slots_at_once_and_more_than_the_whole_kv_never_fits() -> None:
    start = room_at(arr(0.0, 0.0, 0.0), arr(1, 1, 1), arr(4, 4, 4), 1000.0, 2)
    assert start.tolist() == [0.0, 0.0, 4.0]
    start = room_at(arr(0.0, 1.0), arr(2000, 1), arr(4, 4), 1000.0, 8)
    assert math.isinf(start[0]) and start[1] == 1.0  # the impossible one holds nobody up


def test_the_sustained_rate_of_equal_requests_is_what_fits_over_how_long_each_stays() -> None:
    need, hold = np.full(200, 30.0), np.full(200, 2.0)
    assert sustained(need, hold, 100.0, 64) == pytest.approx(3 / 2.0, rel=0.03)  # three fit, each two seconds
    assert sustained(need, hold, 1e9, 4) == pytest.approx(4 / 2.0, rel=0.03)  # the slots bind
    # lengths that vary fit worse than their mean would: the mean is 30, but a long one blocks the rest
    rng = np.random.default_rng(0)
    varied = rng.choice([10.0, 70.0], size=200, p=[5 / 6, 1 / 6])
    varied *= 30.0 / varied.mean()
    assert sustained(varied, hold, 100.0, 64) < 3 / 2.0
    assert sustained(np.full(5, 30.0), np.full(5, 2.0), 100.0, 64) == 0.0  # too few to say
