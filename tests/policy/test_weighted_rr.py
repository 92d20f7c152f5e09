"""DP's dispatcher in Cronus §5.1: weighted round-robin with bounded waiting queues."""

from __future__ import annotations

import pytest

from hetnode.policy.weighted_rr import WeightedRoundRobin


def test_weighted_round_robin_interleaves_three_to_one() -> None:
    rr = WeightedRoundRobin({"a100": 3, "a10": 1}, {"a100": 100, "a10": 100})
    picks = [rr.submit(f"r{i}", {})[0][1] for i in range(8)]
    assert picks.count("a100") == 6 and picks.count("a10") == 2
    assert picks[:4] in (["a100", "a100", "a10", "a100"], ["a100", "a10", "a100", "a100"])


def test_full_queues_hold_requests_at_the_frontend_until_one_has_room() -> None:
    rr = WeightedRoundRobin({"a100": 3, "a10": 1}, {"a100": 3, "a10": 1})
    # The a100's queue is full: the a10 takes it though it weighs less.
    assert rr.submit("r0", {"a100": 3, "a10": 0}) == [("r0", "a10")]
    assert rr.submit("r1", {"a100": 3, "a10": 1}) == []
    assert rr.submit("r2", {"a100": 3, "a10": 1}) == []
    assert rr.dispatch({"a100": 2, "a10": 1}) == [("r1", "a100")]  # one place: the oldest request takes it
    assert rr.dispatch({"a100": 0, "a10": 0}) == [("r2", "a100")] and not rr.held


def test_weighted_round_robin_refuses_bad_settings() -> None:
    with pytest.raises(ValueError):
        WeightedRoundRobin({"a": 1}, {"b": 1})
    with pytest.raises(ValueError):
        WeightedRoundRobin({"a": 0}, {"a": 1})
