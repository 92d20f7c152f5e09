"""The throughput estimate that SWARM's scheduler reads, fed by the runtime's batch loop and the simulated node."""

from __future__ import annotations

import pytest

from hetnode.policy import StepRate


def test_it_moves_a_fifth_of_the_way_to_each_step_and_skips_empty_ones() -> None:
    rate = StepRate(100.0)
    rate.step(50, 0.25)  # 200 tokens/s
    assert rate.value == pytest.approx(120.0)
    rate.step(10, 0.0)
    assert rate.value == pytest.approx(120.0)
    with pytest.raises(ValueError):
        StepRate(weight=0.0)
