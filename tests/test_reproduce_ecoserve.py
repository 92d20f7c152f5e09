"""scripts/reproduce_ecoserve.py (issue 15): its rate grid resolves every goodput it reports, and §4.2's two
testbeds are deployed as the paper states them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from reproduce_ecoserve import PERCENTILES, TESTBEDS, crossing, grid, options


def falling(knee: float) -> tuple[list[float], object]:
    """Attainment 1 up to `knee` req/s, then falling linearly to 0 at twice the knee; records the rates asked."""
    asked: list[float] = []

    def attain(rate: float) -> float:
        asked.append(rate)
        return max(0.0, min(1.0, 2.0 - rate / knee))

    return asked, attain


@pytest.mark.parametrize("start", [0.5, 10.0, 18.0])
def test_the_grid_brackets_every_percentile_whatever_the_start(start: float) -> None:
    asked, attain = falling(knee=10.0)
    points = grid(attain, start)  # type: ignore[arg-type]
    rates = [r for r, _ in points]
    assert rates == sorted(rates) and rates == sorted(asked)
    assert points[0][1] >= max(PERCENTILES) and points[-1][1] < min(PERCENTILES)
    for p in PERCENTILES:
        # The exact crossing of this attainment curve is 10 x (2 - p); the grid finds it to within one step.
        assert crossing(points, p) == pytest.approx(10.0 * (2 - p), rel=0.15)


def test_a_start_past_every_crossing_used_to_report_nothing() -> None:
    """What the grid did before walking down (LongBench's start was near saturation): one point, goodput 0."""
    _, attain = falling(knee=10.0)
    assert crossing([(25.0, attain(25.0))], 0.5) == 0.0  # type: ignore[operator]
    assert crossing(grid(attain, 25.0), 0.5) > 0  # type: ignore[arg-type]


def test_the_grid_gives_up_16x_below_its_start() -> None:
    asked, attain = falling(knee=0.01)
    points = grid(attain, 8.0)  # type: ignore[arg-type]
    assert points[0][0] >= 8.0 / 16 / 1.15 and crossing(points, 0.5) == 0.0 and len(asked) < 30


def test_section_4_2_deployments_on_both_testbeds() -> None:
    l20, a800 = TESTBEDS["l20"], TESTBEDS["a800"]
    o = options("ecoserve", "codellama-34b", l20)
    assert (o.device, o.tp, o.instances, o.per_host, o.nic_gbps) == ("l20", 4, 8, 1, 10.0)
    o = options("ecoserve", "codellama-34b", a800)
    assert (o.device, o.tp, o.instances, o.per_host, o.nic_gbps) == ("a800", 2, 8, 4, 25.0)
    assert (options("vllm", "qwen2-72b", a800).tp, options("vllm", "qwen2-72b", a800).instances) == (4, 4)
    # DistServe pairs a prefill and a decode instance on a node, on as many GPUs as the others use.
    for testbed, model, shape in ((l20, "codellama-34b", (4, 8, 2)), (l20, "qwen2-72b", (4, 8, 2)),
                                  (a800, "codellama-34b", (2, 8, 4)), (a800, "qwen2-72b", (4, 4, 2))):
        o = options("distserve", model, testbed)
        assert (o.tp, o.instances, o.per_host) == shape
        assert o.tp * o.instances == testbed.models[model][0] * testbed.models[model][1]
