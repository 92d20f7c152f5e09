"""A `Roofline` threads from the callers to every step price: its fixed costs add exactly, its efficiencies
scale, and the default prices what the uncalibrated model always did."""

from __future__ import annotations

import statistics

import pytest

from hetnode.planner.costmodel import DEFAULT_ROOFLINE, ROOFLINES, Roofline, peak_seconds, step_time
from hetnode.planner.cronus_fit import fit_chunked_iteration, fit_partial_prefill
from hetnode.planner.devices import parse_device
from hetnode.planner.instance_cost import Chunk, InstanceCost
from hetnode.planner.model import model_spec
from hetnode.testnet.sim.padg import PadgOptions, instance_cost
from hetnode.testnet.sim.pair_designs import DESIGNS, PairSetup, simulate_pair
from hetnode.testnet.sim.pair_engine import Engine, PairRequest, Work, iteration_seconds

STEP = Roofline(step_fixed_s=0.01)  # the default's efficiencies, plus 10 ms a step
LAYER = Roofline(layer_fixed_s=0.001)  # plus 1 ms a layer


def test_the_default_is_the_uncalibrated_model() -> None:
    device, model = parse_device("a100-80g"), model_spec("llama3-8b")
    compute, memory = peak_seconds(device, model.shape, 32, 512, 512)
    assert step_time(device, model.shape, 32, 512, 512) == pytest.approx(max(compute / 0.5, memory / 0.7))
    assert ROOFLINES["default"] is DEFAULT_ROOFLINE and ROOFLINES["fitted"] != DEFAULT_ROOFLINE


def test_fixed_costs_add_exactly_per_step_and_per_layer() -> None:
    device, shape = parse_device("a10"), model_spec("qwen2-7b").shape
    base = step_time(device, shape, 28, 300, 900)
    assert step_time(device, shape, 28, 300, 900, roofline=STEP) == pytest.approx(base + 0.01, abs=1e-12)
    assert step_time(device, shape, 28, 300, 900, roofline=LAYER) == pytest.approx(base + 0.028, abs=1e-12)
    assert step_time(device, shape, 28, 0, 900, roofline=STEP) == 0.0  # no work, no step


def test_efficiencies_scale_the_bound_side() -> None:
    device, shape = parse_device("a100-80g"), model_spec("llama3-8b").shape
    decode = step_time(device, shape, 32, 1, 100)  # memory-bound
    assert step_time(device, shape, 32, 1, 100, roofline=Roofline(memory_efficiency=0.35)) == pytest.approx(2 * decode)
    prefill = step_time(device, shape, 32, 4096, 4096)  # compute-bound
    assert step_time(device, shape, 32, 4096, 4096,
                     roofline=Roofline(compute_efficiency=0.25)) == pytest.approx(2 * prefill)


def test_an_ecoserve_instance_step_takes_the_fixed_cost_once() -> None:
    model = model_spec("codellama-34b")
    base = instance_cost(model, PadgOptions(tp=4))
    fixed = instance_cost(model, PadgOptions(tp=4, roofline=STEP))
    assert isinstance(fixed, InstanceCost) and fixed.roofline == STEP
    chunks, decodes = [Chunk(200, done=100)], [700, 1500, 90]
    assert fixed.step_s(chunks, decodes) == pytest.approx(base.step_s(chunks, decodes) + 0.01, abs=1e-12)
    assert fixed.prefill_s(1000) == pytest.approx(base.prefill_s(1000) + 0.01, abs=1e-12)


def test_a_pair_engine_and_cronus_fits_see_the_same_roofline() -> None:
    high, low, model = parse_device("a100-80g"), parse_device("a30"), model_spec("llama3-8b")
    batch = [Work(PairRequest("a", 0.0, 600, 5), 0, 512, 600), Work(PairRequest("b", 0.0, 80, 5), 300, 1, 80)]
    base = iteration_seconds(high, model.shape, 32, batch)
    assert iteration_seconds(high, model.shape, 32, batch, LAYER) == pytest.approx(base + 0.032, abs=1e-12)
    engine = Engine("e", high, model, 32, kv_tokens=10_000, max_batch_tokens=512, roofline=STEP)
    engine.add(Work(PairRequest("c", 0.0, 100, 5), 0, 100, 100))
    formed = engine.form()
    assert formed is not None
    assert formed[1] == pytest.approx(iteration_seconds(high, model.shape, 32, formed[0]) + 0.01, abs=1e-12)
    # Eq. 2 and Eq. 3's intercepts carry the fixed cost; their slopes do not move.
    # (Eq. 2's intercept is clamped at 0, and the roofline's own is below 0: one second lifts it clear.)
    xs = [64 * 2**i for i in range(8)]
    raw = statistics.linear_regression(xs, [step_time(low, model.shape, 32, n, n, attended_pairs=n * (n + 1) // 2)
                                            for n in xs])
    p0, p1 = fit_partial_prefill(low, model), fit_partial_prefill(low, model, Roofline(step_fixed_s=1.0))
    assert (p1.k, p1.b) == pytest.approx((p0.k, raw.intercept + 1.0), abs=1e-9)
    c0, c1 = fit_chunked_iteration(high, model, 512), fit_chunked_iteration(high, model, 512, STEP)
    assert (c1.k_ctxp, c1.k_ctxd, c1.b) == pytest.approx((c0.k_ctxp, c0.k_ctxd, c0.b + 0.01), abs=1e-9)


def test_every_pair_design_prices_with_its_setups_roofline() -> None:


    setup = PairSetup(parse_device("a100-80g"), parse_device("a10"), model_spec("llama3-8b"))
    slow = PairSetup(setup.high, setup.low, setup.model, roofline=Roofline(step_fixed_s=0.5))
    prompts, outputs = [300, 50, 900], [4, 6, 3]
    for design in DESIGNS:
        a = simulate_pair(design, setup, prompts, outputs, [0.0] * 3)
        b = simulate_pair(design, slow, prompts, outputs, [0.0] * 3)
        # 0.5 s a step against steps of milliseconds: at least one step per output token of the longest request.
        assert b.makespan_s > a.makespan_s + 0.5 * (max(outputs) - 1), design

