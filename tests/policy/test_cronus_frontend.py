"""Cronus's frontend (at most two requests at the PPI, the split taken at dispatch) and DP's weighted round-robin."""

from __future__ import annotations

import pytest

from hetnode.policy.cronus import ChunkedIteration, CpiState, CronusBalancer, LinearPrefill
from hetnode.policy.cronus_frontend import CronusFrontend, WholePrompt
from hetnode.policy.weighted_rr import WeightedRoundRobin

BALANCER = CronusBalancer(LinearPrefill(k=2e-4, b=0.01), ChunkedIteration(k_ctxp=2e-6, k_ctxd=1e-7, b=0.03))


def state(decodes: int = 0, free: int = 10_000) -> CpiState:
    return CpiState(decodes=decodes, decode_context=decodes * 1000, free_blocks=free, block_size=16,
                    max_batch_tokens=512)


def test_at_most_two_requests_are_at_the_ppi_and_the_rest_wait_in_order() -> None:
    f = CronusFrontend(BALANCER)
    sent = [d.request_id for rid in ("a", "b", "c", "d") for d in f.submit(rid, 2000, state())]
    assert sent == ["a", "b"] and [rid for rid, _ in f.waiting] == ["c", "d"]
    assert [d.request_id for d in f.partial_done("a", state())] == ["c"]
    assert [d.request_id for d in f.partial_done("c", state())] == ["d"]
    assert f.partial_done("b", state()) == [] and f.decisions == 4


def test_the_split_is_taken_from_the_cpi_state_at_dispatch_not_at_arrival() -> None:
    f = CronusFrontend(BALANCER)
    f.submit("a", 4096, state())
    f.submit("b", 4096, state())
    assert f.submit("c", 4096, state()) == []  # waits: its split is not decided yet
    busy = state(decodes=64)
    (d,) = f.partial_done("a", busy)
    assert d.split == BALANCER.split(4096, busy) and d.split != BALANCER.split(4096, state())


def test_a_cpi_without_room_gets_nothing_and_whole_prompt_always_prefills_it_all() -> None:
    (d,) = CronusFrontend(BALANCER).submit("a", 4096, state(free=10))
    assert d.split.tokens == 4096
    (w,) = CronusFrontend(WholePrompt()).submit("a", 777, state())
    assert w.split.tokens == 777


def test_cancel_frees_the_place_and_bad_input_is_refused() -> None:
    f = CronusFrontend(BALANCER, ppi_limit=1)
    f.submit("a", 100, state())
    f.submit("b", 100, state())
    f.submit("c", 100, state())
    assert f.cancel("b", state()) == []  # a waiting one leaves the queue
    assert [d.request_id for d in f.cancel("a", state())] == ["c"]
    with pytest.raises(ValueError, match="already"):
        f.submit("c", 100, state())
    with pytest.raises(ValueError, match="at least one token"):
        f.submit("x", 0, state())
    with pytest.raises(ValueError, match="not at the PPI"):
        f.partial_done("nobody", state())
    with pytest.raises(ValueError):
        CronusFrontend(BALANCER, ppi_limit=0)


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
