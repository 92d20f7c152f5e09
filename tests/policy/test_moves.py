"""The move policy that the runtime's coordinator and the simulated one both ask."""

from __future__ import annotations

import pytest

from hetnode.policy import MovePolicy, Restart


def test_a_move_re_prefills_what_the_coordinator_received_and_generates_the_rest() -> None:
    policy = MovePolicy(3)
    assert policy.restart(100, 0, 16) == Restart(100, 16)
    assert policy.restart(100, 5, 16) == Restart(105, 11)
    with pytest.raises(ValueError):
        policy.restart(100, 16, 16)  # nothing left: the request has ended, it does not move


def test_moves_are_bounded() -> None:
    assert [MovePolicy(2).may_move(n) for n in range(4)] == [True, True, False, False]
    assert not MovePolicy(0).may_move(0)
    with pytest.raises(ValueError):
        MovePolicy(-1)
