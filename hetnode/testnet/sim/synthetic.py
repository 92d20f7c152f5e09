"""Length distributions matching EcoServe's Table 4 (Alpaca-gpt4, ShareGPT, LongBench), which we cannot download.

Each is drawn so that its mean and median match the table's, inputs truncated at 4096 tokens as the paper does:

- a right-skewed length (mean > median: every output, and the Alpaca and ShareGPT inputs) is log-normal with
  median m and sigma = sqrt(2 ln(mean / m)), since a log-normal's mean is m e^(sigma^2 / 2);
- LongBench's inputs are left-skewed (mean 2686.89 < median 2736.5, bounded by the 4096 cut): a Beta on [0, 4096]
  whose mean is the table's and whose concentration puts its median at the table's (solved by bisection).

The draws are seeded; `table4_trace` returns them as a `Trace` (timestamps 1 s apart: the runs use Poisson
arrivals at the rate they choose). `check` reports the drawn means and medians beside the table's.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass

from scipy.stats import beta as beta_dist

from hetnode.errors import ConfigError
from hetnode.testnet.sim.workload import Trace

MAX_INPUT = 4096


@dataclass(frozen=True)
class Table4Row:
    in_mean: float
    in_median: float
    out_mean: float
    out_median: float
    ttft_s: float
    tpot_s: float


TABLE4 = {
    "alpaca": Table4Row(20.63, 17.0, 163.80, 119.0, 1.0, 0.1),
    "sharegpt": Table4Row(343.76, 148.0, 237.20, 152.0, 5.0, 0.1),
    "longbench": Table4Row(2686.89, 2736.5, 101.78, 19.0, 15.0, 0.1),
}


def _lognormal(rng: random.Random, mean: float, median: float, cap: int) -> int:
    sigma = math.sqrt(2 * math.log(mean / median))
    return max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma))))


def _beta_for(mean: float, median: float) -> tuple[float, float]:
    """Beta(a, b) on [0, MAX_INPUT] with the given mean and median (left-skewed: mean < median)."""
    mu = mean / MAX_INPUT
    lo, hi = 0.5, 500.0  # concentration a + b: the median moves toward the mean as it grows
    for _ in range(80):
        k = math.sqrt(lo * hi)
        med = float(beta_dist.median(mu * k, (1 - mu) * k)) * MAX_INPUT
        if med > median:
            lo = k
        else:
            hi = k
    k = math.sqrt(lo * hi)
    return mu * k, (1 - mu) * k


def table4_trace(name: str, n: int = 4000, seed: int = 0) -> Trace:
    """`n` requests with Table 4's length distribution for dataset `name`."""
    row = TABLE4.get(name)
    if row is None:
        raise ConfigError(f"unknown dataset {name!r}; Table 4 has {', '.join(TABLE4)}")
    rng = random.Random(seed)
    if row.in_mean > row.in_median:
        inputs = [_lognormal(rng, row.in_mean, row.in_median, MAX_INPUT) for _ in range(n)]
    else:
        a, b = _beta_for(row.in_mean, row.in_median)
        inputs = [max(1, round(rng.betavariate(a, b) * MAX_INPUT)) for _ in range(n)]
    outputs = [_lognormal(rng, row.out_mean, row.out_median, 4096) for _ in range(n)]
    return Trace(name=f"{name}-table4", timestamps=tuple(float(i) for i in range(n)), inputs=tuple(inputs),
                 outputs=tuple(outputs), source=f"synthesized to EcoServe Table 4's {name} means and medians")


def check(trace: Trace) -> dict[str, float]:
    return {"in_mean": statistics.fmean(trace.inputs), "in_median": statistics.median(trace.inputs),
            "out_mean": statistics.fmean(trace.outputs), "out_median": statistics.median(trace.outputs)}
