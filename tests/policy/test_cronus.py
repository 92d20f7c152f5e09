"""Cronus's balancer: the split point that makes the low-end GPU's partial prefill and the high-end GPU's
chunked rest take the same time; its predictors fitted on the cost model."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetnode.planner.costmodel import step_time
from hetnode.planner.cronus_fit import fit_chunked_iteration, fit_partial_prefill
from hetnode.planner.devices import parse_device
from hetnode.planner.model import PRESETS
from hetnode.policy.cronus import ChunkedIteration, CpiState, CronusBalancer, LinearPrefill

PPI = LinearPrefill(k=2e-4, b=0.01)  # a low-end GPU: 0.2 ms a token
CPI = ChunkedIteration(k_ctxp=2e-6, k_ctxd=1e-7, b=0.03)  # an iteration: 30 ms and a little per context token
IDLE = CpiState(decodes=0, decode_context=0, free_blocks=10_000, block_size=16, max_batch_tokens=512)


def brute_force(balancer: CronusBalancer, prompt: int, state: CpiState) -> float:
    """The smallest |T_p - T_c| over the same candidates, computed independently."""
    per = state.max_batch_tokens - state.decodes
    best = math.inf
    for i in range(1, 513):
        lp = math.ceil(prompt * i / 512)
        rest = prompt - lp
        t_c = 0.0
        if rest:
            n = math.ceil(rest / per)
            t_c = n * (CPI.seconds(lp + min(rest, per), state.decode_context)
                       + CPI.seconds(prompt, state.decode_context)) / 2
        best = min(best, abs(PPI.seconds(lp) - t_c))
    return best


@settings(max_examples=80, deadline=None)
@given(prompt=st.integers(1, 16_384), decodes=st.integers(0, 200), context=st.integers(0, 400_000))
def test_the_split_balances_the_two_predicted_times(prompt: int, decodes: int, context: int) -> None:
    balancer = CronusBalancer(PPI, CPI)
    state = CpiState(decodes=decodes, decode_context=context, free_blocks=10_000, block_size=16,
                     max_batch_tokens=512)
    split = balancer.split(prompt, state)
    assert 1 <= split.tokens <= prompt
    assert abs(split.ppi_s - split.cpi_s) == pytest.approx(brute_force(balancer, prompt, state))
    assert split.ppi_s == pytest.approx(PPI.seconds(split.tokens))


def test_a_busier_cpi_or_a_faster_ppi_moves_the_split_towards_the_ppi() -> None:
    balancer = CronusBalancer(PPI, CPI)
    idle = balancer.split(4096, IDLE).tokens
    busy = balancer.split(4096, CpiState(decodes=64, decode_context=64 * 2000, free_blocks=10_000, block_size=16,
                                         max_batch_tokens=512)).tokens
    fast = CronusBalancer(LinearPrefill(k=5e-5, b=0.01), CPI).split(4096, IDLE).tokens
    assert 0 < idle < busy < 4096 and idle < fast < 4096


def test_without_kv_room_on_the_cpi_the_ppi_prefills_it_all() -> None:
    full = CpiState(decodes=10, decode_context=5000, free_blocks=3, block_size=16, max_batch_tokens=512)
    assert CronusBalancer(PPI, CPI).split(49, full).tokens == 49  # 49 tokens need 4 blocks
    assert CronusBalancer(PPI, CPI).split(48, full).tokens < 48
    no_budget = CpiState(decodes=512, decode_context=5000, free_blocks=100, block_size=16, max_batch_tokens=512)
    assert CronusBalancer(PPI, CPI).split(100, no_budget).tokens == 100
    with pytest.raises(ValueError):
        CronusBalancer(PPI, CPI).split(0, IDLE)
    with pytest.raises(ValueError):
        CpiState(decodes=0, decode_context=0, free_blocks=1, block_size=0, max_batch_tokens=1)


def test_the_predictors_fitted_on_the_cost_model_track_it() -> None:
    model = PRESETS["llama3-8b"]
    shape = model.shape
    low, high = parse_device("l4"), parse_device("a100")
    ppi = fit_partial_prefill(low, model)
    for n in (256, 2048, 8192):
        want = step_time(low, shape, model.num_layers, n, n, attended_pairs=n * (n + 1) // 2)
        assert ppi.seconds(n) == pytest.approx(want, rel=0.25)
    cpi = fit_chunked_iteration(high, model, 512)
    assert cpi.k_ctxp > 0 and cpi.k_ctxd >= 0 and cpi.b > 0
    want = step_time(high, shape, model.num_layers, 512 - 32, 4096 + 32 * 1024,
                     attended_pairs=(512 - 32) * 4096 + 32 * 1024)
    assert cpi.seconds(4096, 32 * 1024) == pytest.approx(want, rel=0.25)
    # An L4 prefilling for an A100: the split gives the L4 a part of a long prompt, not all of it.
    split = CronusBalancer(ppi, cpi).split(4096, IDLE)
    assert 0 < split.tokens < 4096
