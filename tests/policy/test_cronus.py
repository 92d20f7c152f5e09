"""Cronus's balancer: the split point that makes the low-end GPU's partial prefill and the high-end GPU's
chunked rest take the same time; its predictors fitted on the cost model."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hetnode.planner.costmodel import step_time
from hetnode.planner.cronus_fit import fit_chunked_iteration, fit_partial_prefill
from hetnode.planner.devices import parse_device
from hetnode.planner.model import PRESETS
from hetnode.policy.cronus import ChunkedIteration, CpiState, CronusBalancer, LinearPrefill, _scan_split

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


def fitted_pairs() -> list[tuple[LinearPrefill, ChunkedIteration]]:
    """The coefficients `cronus_fit` gives the papers' pairs (a low-end PPI beside an A100 or H100 CPI)."""
    pairs = []
    for model in (PRESETS["llama3-8b"], PRESETS["llama-70b"]):
        for low in ("a10", "a30", "l4"):
            for high in ("a100", "h100"):
                pairs.append((fit_partial_prefill(parse_device(low), model),
                              fit_chunked_iteration(parse_device(high), model, 512)))
    return pairs


def random_case(rng: random.Random, pairs: list[tuple[LinearPrefill, ChunkedIteration]]
                ) -> tuple[CronusBalancer, int, CpiState]:
    """A prompt, a CPI's state and a balancer: fitted coefficients scaled up to 30x either way (sometimes with
    a negative intercept, as a least-squares fit can give, or a zero), sometimes small dyadic ones whose
    arithmetic is exact; the edges drawn often."""
    ppi, cpi = rng.choice(pairs)

    def around(x: float) -> float:
        return x * math.exp(rng.uniform(-3.4, 3.4)) * rng.choice((1, 1, 1, 1, 0, -1))

    if rng.random() < 0.1:  # exact arithmetic: ties between candidates
        ppi = LinearPrefill(rng.randrange(0, 9) / 8, rng.randrange(-8, 64) / 4)
        cpi = ChunkedIteration(rng.randrange(0, 9) / 64, rng.randrange(0, 5) / 1024, rng.randrange(-8, 64) / 4)
    elif rng.random() < 0.8:
        ppi = LinearPrefill(ppi.k * math.exp(rng.uniform(-3.4, 3.4)), around(ppi.b or 0.02))
        cpi = ChunkedIteration(cpi.k_ctxp * math.exp(rng.uniform(-3.4, 3.4)), abs(around(cpi.k_ctxd)),
                               around(cpi.b))
    edge = rng.random() < 0.15  # one of the edges below, else the usual: a long prompt, a roomy CPI
    prompt = rng.choice((1, 2, 3, rng.randint(1, 700)) if edge else
                        (int(math.exp(rng.uniform(0, math.log(32_768)))), rng.randint(1, 32_768)))
    budget = rng.choice((512, 512, 256, 1024, 2048, rng.randint(1, 8192)))
    decodes = rng.choice((0, rng.randint(0, 64), rng.randint(0, budget)))
    if edge:
        decodes = rng.choice((decodes, budget - 1, budget))  # per iteration 1, or 0
    block = rng.choice((1, 16, 32))
    need = -(-prompt // block)
    free = rng.choice((need, need - 1, 0, rng.randint(0, 2 * need))) if edge else 100_000
    state = CpiState(decodes=decodes, decode_context=decodes * rng.randint(0, 8192), free_blocks=max(0, free),
                     block_size=block, max_batch_tokens=budget)
    candidates = rng.choice((1, 2, rng.randint(1, 2048))) if edge and rng.random() < 0.3 else 512
    per = budget - decodes
    if not edge and per >= 1 and prompt > 1 and rng.random() < 0.3:
        # The hard cases: T_p - T_c crossing zero inside a chosen segment (sometimes half way between two
        # tokens, where two candidates can tie), whose line is sometimes flat to within rounding.
        n = rng.randint(1, -(-(prompt - 1) // per))
        kc, bc = cpi.k_ctxp, cpi.k_ctxd * state.decode_context + cpi.b
        last = kc * prompt + bc
        kp = ppi.k
        if rng.random() < 0.5:
            kp = n * kc / 2 * (1 + rng.choice((0, 1, -1)) * 10 ** rng.uniform(-16, -11))
        root = prompt - n * per + rng.random() * per
        root = round(root * 2) / 2 if rng.random() < 0.5 else root
        ppi = LinearPrefill(kp, n * (kc * (root + per) + bc + last) / 2 - kp * root if n > 1 else last - kp * root)
    return CronusBalancer(ppi, cpi, candidates=candidates), prompt, state


def test_the_split_is_the_scans_choice_exactly() -> None:
    """`split` skips most candidates; it must still pick the very one trying them all picks (the first of the
    least gap), with the same predicted times, float for float."""
    rng = random.Random(15)
    pairs = fitted_pairs()
    edges = {"per iteration 1": 0, "prompt 1": 0, "no kv room": 0, "rest < per": 0, "no budget": 0,
             "segments walked": 0, "segments bounded": 0}
    for _ in range(20_000):
        balancer, prompt, state = random_case(rng, pairs)
        assert balancer.split(prompt, state) == _scan_split(balancer, prompt, state), (balancer.ppi, balancer.cpi,
                                                                                      balancer.candidates, prompt,
                                                                                      state)
        per = state.max_batch_tokens - state.decodes
        room = state.free_blocks >= -(-prompt // state.block_size)
        edges["per iteration 1"] += per == 1 and room
        edges["prompt 1"] += prompt == 1
        edges["no kv room"] += not room
        edges["rest < per"] += room and 1 < prompt <= per
        edges["no budget"] += per < 1 and room
        # The cases that take the segment walk (several segments of several candidates each), with and
        # without the order between segments (a negative intercept can leave b_c below zero).
        if room and per >= 1 and 2 < -(-(prompt - 1) // per) + 1 < min(prompt, balancer.candidates) // 4:
            ordered = state.decode_context * balancer.cpi.k_ctxd + balancer.cpi.b >= 0
            edges["segments bounded" if ordered else "segments walked"] += 1
    assert min(edges.values()) >= 100 and edges["segments bounded"] >= 5000, edges


def test_ties_go_to_the_earliest_candidate_as_in_the_scan() -> None:
    # No CPI cost at all and a free PPI: every candidate's gap is 0, and the scan keeps the first one.
    free = CronusBalancer(LinearPrefill(0.0, 0.0), ChunkedIteration(0.0, 0.0, 0.0))
    assert free.split(5000, IDLE) == _scan_split(free, 5000, IDLE)
    assert free.split(5000, IDLE).tokens == math.ceil(5000 / 512)
    # A segment where T_p - T_c is flat (k_p = N k_ctxp / 2 for N = 2): the gaps there are equal, exactly.
    flat = CronusBalancer(LinearPrefill(0.25, 0.0), ChunkedIteration(0.25, 0.0, 0.0))
    for prompt in (1000, 1100, 4000):
        assert flat.split(prompt, IDLE) == _scan_split(flat, prompt, IDLE)
