"""The lifecycle policy that the runtime's coordinator and hops and the simulated ones all ask."""

from __future__ import annotations

import pytest

from hetnode.policy import Lifecycle, Restart


def test_a_move_re_prefills_what_the_coordinator_received_and_generates_the_rest() -> None:
    policy = Lifecycle(3)
    assert policy.restart(100, 0, 16) == Restart(100, 16)
    assert policy.restart(100, 5, 16) == Restart(105, 11)
    with pytest.raises(ValueError):
        policy.restart(100, 16, 16)  # nothing left: the request has ended, it does not move


def test_moves_are_bounded_and_a_refusal_never_moves() -> None:
    policy = Lifecycle(2)
    assert [policy.moves("lost", n) for n in range(4)] == [True, True, False, False]
    assert [policy.moves("preempted", n) for n in range(3)] == [True, True, False]
    assert not policy.moves("refused", 0)
    assert not Lifecycle(0).moves("lost", 0)
    with pytest.raises(ValueError):
        Lifecycle(-1)
    with pytest.raises(ValueError):
        policy.moves("tired", 0)  # type: ignore[arg-type]


def test_only_the_item_that_completes_the_prompt_and_decode_items_sample() -> None:
    assert not Lifecycle.samples(64, 100)
    assert Lifecycle.samples(100, 100)
    assert Lifecycle.samples(101, 100)


def test_after_a_token_a_phase_loops_hands_off_or_ends() -> None:
    assert Lifecycle.after_token("mixed", 1, 4, False) == "loop"
    assert Lifecycle.after_token("decode", 3, 4, False) == "loop"
    assert Lifecycle.after_token("mixed", 4, 4, False) == "end"
    assert Lifecycle.after_token("decode", 1, 4, True) == "end"
    assert Lifecycle.after_token("prefill", 1, 4, False) == "handoff"
    assert Lifecycle.after_token("prefill", 1, 1, False) == "end"  # one token asked: nothing to hand over


def test_the_coordinator_ends_a_request_at_its_last_token() -> None:
    assert not Lifecycle.ends(3, 4, False)
    assert Lifecycle.ends(4, 4, False)
    assert Lifecycle.ends(1, 4, True)


def test_a_node_that_died_fails_every_route_through_it_one_that_left_only_its_last_phase() -> None:
    split = [{"p0", "p1"}, {"d0"}]
    assert Lifecycle.fails_when_down("p1", split, left=False)  # its KV may still have been on the way
    assert Lifecycle.fails_when_down("d0", split, left=False)
    assert not Lifecycle.fails_when_down("x", split, left=False)
    assert not Lifecycle.fails_when_down("p1", split, left=True)  # it sent its KV before it went
    assert Lifecycle.fails_when_down("d0", split, left=True)
    assert not Lifecycle.fails_when_down("d0", [], left=True)
    # A prefill node that left still keeping KV the decode phase waits for (a queued hand-off not started) takes
    # the session with it; one that had sent it does not.
    assert Lifecycle.fails_when_down("p1", split, left=True, holding={"p1"})
    assert not Lifecycle.fails_when_down("p1", split, left=True, holding={"p0"})
