"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs, stop tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_pipeline, sessions
from hypothesis import given
from hypothesis import strategies as st

from hetnode.errors import ConfigError
from hetnode.node.engine import Request, SamplingParams
from hetnode.node.engine.sampling import sample, uniform

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0, 0.0]])


@given(st.integers(0, 2**64 - 1), st.integers(0, 1 << 40))
def test_uniform_is_a_pure_function_into_unit_interval(seed: int, position: int) -> None:
    u = uniform(seed, position)
    assert 0.0 <= u < 1.0
    assert u == uniform(seed, position)


def test_greedy_picks_the_argmax_per_row() -> None:
    logits = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    draws = sample(logits, [SamplingParams()] * 5, [1, 2, 3, 4, 5])
    assert [d.token for d in draws] == logits.argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    for params in (SamplingParams(temperature=1.5, top_k=1, seed=1), SamplingParams(temperature=1.5, top_p=1e-6)):
        assert all(sample(LOGITS, [params], [p])[0].token == 4 for p in range(50))


def test_top_k_and_top_p_restrict_the_support() -> None:
    top3 = {4, 0, 1}
    for position in range(200):
        k = sample(LOGITS, [SamplingParams(temperature=5.0, top_k=3, seed=9)], [position])[0].token
        assert k in top3
        # probabilities at T=1: 3.0 -> .53, 2.0 -> .20, 1.0 -> .07 ...; top_p .7 keeps the first two.
        p = sample(LOGITS, [SamplingParams(temperature=1.0, top_p=0.7, seed=9)], [position])[0].token
        assert p in {4, 0}


def test_temperature_sampling_follows_the_softmax() -> None:
    params = SamplingParams(temperature=1.0, seed=1234)
    counts = torch.zeros(LOGITS.shape[1])
    n = 4000
    for position in range(n):
        counts[sample(LOGITS, [params], [position])[0].token] += 1
    expected = torch.softmax(LOGITS[0], -1)
    assert torch.allclose(counts / n, expected, atol=0.03)


def test_logprobs_are_the_models_log_softmax() -> None:
    [draw] = sample(LOGITS, [SamplingParams(logprobs=2, return_logits=True)], [0])
    log_probs = torch.log_softmax(LOGITS[0], -1)
    assert draw.logprob == pytest.approx(float(log_probs[4]))
    assert draw.top_logprobs is not None
    assert [t for t, _ in draw.top_logprobs] == [4, 0]
    assert draw.logits is not None and torch.equal(draw.logits, LOGITS[0])


def test_vanishing_temperature_is_greedy_not_garbage() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(5)) * 30
    greedy = logits.argmax(-1).tolist()
    # 1e-300 is 0.0 in float32 (the old division gave NaN); 1e-30 is a normal float32 whose quotients overflow.
    for temperature in (1e-300, 5e-324, 1e-39, 1e-30, 1e-6):
        for extra in ({}, {"top_k": 5}, {"top_p": 0.9}):
            params = SamplingParams(temperature=temperature, seed=11, **extra)  # type: ignore[arg-type]
            for position in range(20):
                assert [d.token for d in sample(logits, [params] * 4, [position] * 4)] == greedy, (temperature, extra)


def test_bad_parameters_are_config_errors() -> None:
    for kwargs in ({"temperature": -1.0}, {"top_p": 0.0}, {"top_k": -2}, {"seed": -1}, {"logprobs": 99},
                   {"temperature": float("nan")}, {"top_p": float("nan")}, {"temperature": float("inf")}):
        with pytest.raises(ConfigError):
            SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_seeded_request_gives_the_same_tokens_alone_or_batched(tiny_llama: Path) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    prompt = [20, 30, 40, 50]
    alone = make_pipeline(tiny_llama, 1).generate([Request(sessions(1)[0], prompt, 12, seeded)])[0].tokens
    others = [
        Request(s, [7 + i, 8, 9], 12, SamplingParams(temperature=0.8, seed=i), arrival_step=i)
        for i, s in enumerate(sessions(4)[1:])
    ]
    batched = make_pipeline(tiny_llama, 2).generate([Request(sessions(1)[0], prompt, 12, seeded), *others])
    assert batched[0].tokens == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=43)
    assert make_pipeline(tiny_llama, 1).generate([Request(sessions(1)[0], prompt, 12, other_seed)])[0].tokens != alone


def test_stop_token_ends_the_session(tiny_llama: Path) -> None:
    pipe = make_pipeline(tiny_llama, 1)
    free = pipe.generate([Request(sessions(1)[0], [20, 30, 40], 8)])[0]
    stop_at = free.tokens[2]
    stopped = pipe.generate([Request(sessions(1)[0], [20, 30, 40], 8, SamplingParams(stop_token_ids=(stop_at,)))])
    assert stopped[0].tokens == free.tokens[: free.tokens.index(stop_at) + 1]
    assert stopped[0].finish_reason == "stop" and free.finish_reason == "length"
