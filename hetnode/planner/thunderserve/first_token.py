"""A prefill replica's time to first token for a sample of requests: Poisson arrivals of prompts whose lengths vary,
queued first come first served at every station of its pipeline (its stages and the hops between them).

ThunderServe estimates D with DistServe's simulator, which replays requests of the workload's lengths (§3.3);
this is that simulator's prefill side, small enough for every replica of every deployment the search scores.
It replaces an M/M/1 queue at the slowest stage with prompts of the mean length, which misses what dominates a
deep pipeline: a prompt cannot overtake the one ahead of it at any stage, so a short prompt behind a long one
waits for it at every stage, not once. Measured on our coding plan (issue 14): a 24-stage prefill pipeline
loaded to a fifth of its rate gave a mean TTFT of 5.5 s in the simulator, where its mean prompt alone takes
2.2 s and the M/M/1 estimate was 2.3 s; a 77-token prompt took 3.9 s.

Each station k is a FIFO server; job n reaches it at R_k(n) (the departure from station k - 1) and needs
s_k(n), so it leaves at D_k(n) = max(D_k(n - 1), R_k(n)) + s_k(n), which unrolls to
D_k(n) = S_k(n) + max over m <= n of (R_k(m) - S_k(m - 1)), S_k the prefix sums of s_k over jobs: one cumulative
maximum per station, so a sample runs as a few array operations a station.

The sample is fixed by the traffic and the seed (stratified lognormal lengths, exponential gaps at unit rate,
scaled by the load), so the planner stays deterministic and every replica is judged on the same requests.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from hetnode.planner.thunderserve.settings import Traffic

Array = npt.NDArray[np.float64]
SAMPLE = 256  # requests in a sample: D is a mean over them, so a share is good to about 3%
GRID_POINTS = 12  # prompt lengths a replica's station times are computed at (interpolated between)


@dataclass(frozen=True, eq=False)
class LengthSample:
    """SAMPLE requests: prompt and output lengths, arrival times at a rate of one request a second, and a uniform
    draw each that routes it (`picked`)."""

    inputs: Array
    outputs: Array
    arrivals: Array
    draws: Array

    def picked(self, share: float) -> npt.NDArray[np.bool_]:
        """Which requests a pair that takes `share` of a prefill replica's requests gets: a random split, the
        same requests for the same share."""
        out: npt.NDArray[np.bool_] = self.draws < share
        return out

    @property
    def input_ratio(self) -> Array:
        """Each prompt's length over the sample's mean (what its KV hand-off costs against the mean's)."""
        return self.inputs / float(self.inputs.mean())


def length_sample(traffic: Traffic, seed: int, size: int = SAMPLE) -> LengthSample:
    """The traffic's lengths as `size` requests (lognormal at each mean and coefficient of variation, at evenly
    spaced quantiles in a shuffled order) arriving as a Poisson process of rate 1."""
    rng = np.random.default_rng(seed)
    quantiles = (np.arange(size) + 0.5) / size

    def lengths(mean: float, cv: float) -> Array:
        if cv <= 0:
            return np.full(size, float(max(1, round(mean))))
        sigma = math.sqrt(math.log1p(cv * cv))
        normal = statistics.NormalDist(math.log(mean) - sigma * sigma / 2, sigma)
        drawn = np.array([normal.inv_cdf(float(q)) for q in quantiles])
        out: Array = np.maximum(1.0, np.round(np.exp(rng.permutation(drawn))))
        return out

    inputs = lengths(traffic.input_len, traffic.input_cv)
    outputs = lengths(traffic.output_len, traffic.output_cv)
    arrivals = np.cumsum(rng.exponential(1.0, size))
    return LengthSample(inputs=inputs, outputs=outputs, arrivals=arrivals, draws=rng.random(size))


@dataclass(frozen=True, eq=False)
class StationCurve:
    """A pipeline's seconds at each station for a prompt of each of some lengths (`grid`, rising)."""

    grid: Array  # prompt tokens
    seconds: Array  # [len(grid), stations]

    def at(self, tokens: Array) -> Array:
        """[stations, len(tokens)]: each station's time for each prompt, linear between the grid's lengths."""
        return np.array([np.interp(tokens, self.grid, self.seconds[:, k]) for k in range(self.seconds.shape[1])])


def station_curve(stations: Callable[[int], Sequence[float]], sample: LengthSample) -> StationCurve:
    """`stations(tokens)` (seconds at each station for one prompt) at GRID_POINTS lengths spanning the sample's."""
    lo, hi = float(sample.inputs.min()), float(sample.inputs.max())
    grid = np.unique(np.round(np.geomspace(lo, max(lo, hi), GRID_POINTS)))
    return StationCurve(grid=grid.astype(np.float64), seconds=np.array([stations(int(t)) for t in grid],
                                                                       dtype=np.float64))


def first_token_s(curve: StationCurve, sample: LengthSample, load: float) -> Array:
    """Each sampled request's time from arrival to its last prefill station's end at `load` requests/s (module
    docstring); inf for all when the load is not positive and finite."""
    if not (load > 0 and math.isfinite(load)):
        return np.full(len(sample.inputs), math.inf)
    arrivals = sample.arrivals / load
    reach = arrivals
    for service in curve.at(sample.inputs):
        reach = fifo_departures(reach, service)
    out: Array = reach - arrivals
    return out


def fifo_departures(reach: Array, service: Array) -> Array:
    """When each job leaves a first-come-first-served server it reaches at `reach` (in job order) and that serves
    it in `service`: S(n) + max over m <= n of (reach(m) - S(m - 1)), S the prefix sums of `service` (module
    docstring). The prefill stations here and the hand-off links (`slo.link_queues`) are such servers."""
    before = np.concatenate(([0.0], np.cumsum(service)[:-1]))  # S(n - 1)
    out: Array = before + service + np.maximum.accumulate(reach - before)
    return out
