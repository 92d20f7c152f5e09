"""The prefill replica's first tokens as tandem FIFO stations (planner/thunderserve/first_token.py) and the KV
hand-off's link queues (slo.link_queues), each against a plain event-by-event recursion."""

from __future__ import annotations

import numpy as np
import pytest

from hetnode.planner.thunderserve.first_token import (
    LengthSample,
    StationCurve,
    first_token_s,
    length_sample,
    station_curve,
)
from hetnode.planner.thunderserve.settings import Traffic
from hetnode.planner.thunderserve.slo import Handoff, link_queues


def tandem(arrivals: list[float], service: list[list[float]]) -> list[float]:
    """Departures from the last of FIFO stations in series, one job at a time: D_k(n) = max(D_k(n - 1),
    D_{k-1}(n)) + s_k(n)."""
    free = [0.0] * len(service)
    out = []
    for n, t in enumerate(arrivals):
        for k, station in enumerate(service):
            t = max(t, free[k]) + station[n]
            free[k] = t
        out.append(t)
    return out


def sample_of(inputs: list[float], arrivals: list[float]) -> LengthSample:
    size = len(inputs)
    return LengthSample(inputs=np.array(inputs, dtype=float), outputs=np.ones(size), arrivals=np.array(arrivals),
                        draws=np.zeros(size))


def test_first_tokens_are_the_tandem_queues_departures() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        jobs, stations = int(rng.integers(1, 40)), int(rng.integers(1, 12))
        inputs = rng.integers(1, 4000, jobs).astype(float).tolist()
        arrivals = np.cumsum(rng.exponential(1.0, jobs)).tolist()
        # a station's time is linear in the prompt between its grid points; here linear outright
        per_token = rng.uniform(1e-5, 1e-3, stations)
        fixed = rng.uniform(0.0, 0.01, stations)
        grid = np.array([1.0, 4000.0])
        curve = StationCurve(grid=grid, seconds=np.array([fixed + per_token * g for g in grid]))
        load = float(rng.uniform(0.2, 3.0))
        got = first_token_s(curve, sample_of(inputs, arrivals), load)
        times = [a / load for a in arrivals]
        service = [[fixed[k] + per_token[k] * x for x in inputs] for k in range(stations)]
        want = np.array(tandem(times, service)) - np.array(times)
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_a_short_prompt_behind_a_long_one_waits_at_every_stage() -> None:
    # The convoy an M/M/1 queue at the slowest stage does not see: 24 stages of 0.1 s for the long prompt and
    # 0.003 s for the short one, which comes 0.01 s later: it leaves just after the long one, 2.4 s, where alone
    # it takes 0.072 s.
    curve = StationCurve(grid=np.array([100.0, 3000.0]), seconds=np.array([[0.003] * 24, [0.1] * 24]))
    first = first_token_s(curve, sample_of([3000.0, 100.0], [0.0, 0.01]), 1.0)
    assert first[0] == pytest.approx(2.4)
    assert first[1] == pytest.approx(2.4 + 0.003 - 0.01)
    alone = first_token_s(curve, sample_of([100.0], [0.0]), 1.0)
    assert alone[0] == pytest.approx(0.072)


def test_the_spread_of_prompts_costs_a_deep_pipeline_more_than_a_shallow_one() -> None:
    # The same rate (the slowest station) and the same mean prompt, 1 stage against 24: with every prompt of the
    # mean length both wait little at a fifth of their rate; with the coding trace's spread (CV 0.96) the deep
    # pipeline's mean first token grows by seconds, the shallow one's by a fraction of its prompt time.
    def curve(stages: int, seconds: float) -> StationCurve:
        grid = np.array([1.0, 50_000.0])
        return StationCurve(grid=grid, seconds=np.array([[seconds * g / 2048] * stages for g in grid]))

    deep, shallow = curve(24, 0.1), curve(1, 0.1)
    same = length_sample(Traffic(input_len=2048, output_len=28), seed=0)
    spread = length_sample(Traffic(input_len=2048, output_len=28, input_cv=0.96), seed=0)
    load = 2.0  # a fifth of 1 / 0.1 s
    grew_deep = first_token_s(deep, spread, load).mean() - first_token_s(deep, same, load).mean()
    grew_shallow = first_token_s(shallow, spread, load).mean() - first_token_s(shallow, same, load).mean()
    assert grew_deep > 1.0
    assert grew_shallow < 0.1
    assert np.isinf(first_token_s(deep, same, 0.0)).all()


def test_the_length_sample_has_the_traffics_mean_and_spread_and_is_fixed_by_the_seed() -> None:
    traffic = Traffic(input_len=2048, output_len=28, input_cv=0.96, output_cv=2.15)
    sample = length_sample(traffic, seed=1)
    for values, mean, cv in ((sample.inputs, 2048, 0.96), (sample.outputs, 28, 2.15)):
        assert values.mean() == pytest.approx(mean, rel=0.05)
        assert values.std() / values.mean() == pytest.approx(cv, rel=0.3)  # a heavy tail, 512 stratified draws
        assert (values >= 1).all()
    again = length_sample(traffic, seed=1)
    assert (again.inputs == sample.inputs).all() and (again.arrivals == sample.arrivals).all()
    assert not (length_sample(traffic, seed=2).inputs == sample.inputs).all()
    flat = length_sample(Traffic(input_len=100.4, output_len=7), seed=0)
    assert (flat.inputs == 100).all() and (flat.outputs == 7).all()
    assert np.diff(flat.arrivals).mean() == pytest.approx(1.0, rel=0.15)
    assert sample.picked(0.25).mean() == pytest.approx(0.25, abs=0.06)
    assert (sample.picked(0.25) <= sample.picked(0.5)).all()  # a larger share keeps the smaller one's requests


def test_a_station_curve_spans_the_samples_prompts() -> None:
    sample = length_sample(Traffic(input_len=1000, output_len=10, input_cv=1.0), seed=0)
    curve = station_curve(lambda tokens: [tokens * 1e-4, 0.01], sample)
    assert curve.grid[0] == sample.inputs.min() and curve.grid[-1] == sample.inputs.max()
    at = curve.at(sample.inputs)
    assert at.shape == (2, len(sample.inputs))
    assert at[0] == pytest.approx(sample.inputs * 1e-4)
    assert at[1] == pytest.approx(0.01)


def test_hand_offs_queue_on_each_link_and_finish_with_the_slowest() -> None:
    rng = np.random.default_rng(4)
    for _ in range(20):
        jobs, links = int(rng.integers(1, 30)), int(rng.integers(1, 5))
        ready = np.cumsum(rng.exponential(0.5, jobs))
        ratio = rng.uniform(0.1, 3.0, jobs)
        seconds = tuple(float(x) for x in rng.uniform(0.01, 1.0, links))
        handoff = Handoff(max(seconds), ("int4",) * links, tuple((0, k + 1, 1.0) for k in range(links)), seconds)
        got = link_queues(ready, ratio, handoff)
        each = [tandem(ready.tolist(), [[s * r for r in ratio]]) for s in seconds]
        assert got == pytest.approx(np.max(np.array(each), axis=0))
    assert link_queues(np.array([1.0]), np.array([1.0]), Handoff(0.0, ("fp16",))) == pytest.approx([1.0])
