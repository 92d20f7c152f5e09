"""A `Roofline` fitted by least squares on measured step times (scripts/fit_roofline.py feeds it Splitwise's).

Each measured step is an `Observation`: its compute and memory seconds at the devices' peaks
(`costmodel.peak_seconds`), the seconds of tensor-parallel all-reduce the cost model charges for it
(`all_reduce`), the layers it ran and the time measured. The model is

    predicted = max(compute / eff_c, memory / eff_m) + all_reduce + layers * layer_fixed + step_fixed

The two efficiencies sit inside a max, so they are searched on a grid (steps of 0.01); for each pair the fixed
costs are linear and solved in closed form, kept non-negative. The error is relative ((predicted - measured) /
measured): measured steps span 40 ms decodes to 9 s batched prefills, and an absolute error would fit only the
long prefills, while the simulations run mostly short steps.

Pure: numbers in, numbers out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hetnode.planner.costmodel import Roofline

GRID = np.round(np.arange(0.05, 1.0001, 0.01), 2)


@dataclass(frozen=True)
class Observation:
    compute_s: float  # at peak FLOP/s
    memory_s: float  # at peak memory bandwidth
    all_reduce_s: float
    layers: int
    measured_s: float


def predict(roofline: Roofline, obs: Observation) -> float:
    return (max(obs.compute_s / roofline.compute_efficiency, obs.memory_s / roofline.memory_efficiency)
            + obs.all_reduce_s + obs.layers * roofline.layer_fixed_s + roofline.step_fixed_s)


def relative_errors(roofline: Roofline, observations: Sequence[Observation]) -> list[float]:
    return [predict(roofline, o) / o.measured_s - 1 for o in observations]


def _fixed_costs(gap: np.ndarray, layers: np.ndarray, measured: np.ndarray, per_layer: bool,
                 per_step: bool) -> tuple[float, float, float]:
    """(layer_fixed, step_fixed, sum of squared relative errors) minimizing sum ((L a + b - gap) / y)^2 with
    a, b >= 0, where gap = measured - roofline part (the non-negative least squares of two unknowns: the
    unconstrained solution if it is feasible, else the best with one or both at zero)."""
    w = 1 / measured
    cols = {"a": layers * w, "b": w}
    target = gap * w
    candidates: list[tuple[float, float]] = [(0.0, 0.0)]
    if per_layer:
        x = cols["a"]
        candidates.append((max(0.0, float(x @ target / (x @ x))), 0.0))
    if per_step:
        x = cols["b"]
        candidates.append((0.0, max(0.0, float(x @ target / (x @ x)))))
    if per_layer and per_step:
        m = np.stack([cols["a"], cols["b"]], axis=1)
        sol, *_ = np.linalg.lstsq(m, target, rcond=None)
        if sol[0] >= 0 and sol[1] >= 0:
            candidates.append((float(sol[0]), float(sol[1])))
    best = min(candidates, key=lambda ab: float(np.sum((cols["a"] * ab[0] + cols["b"] * ab[1] - target) ** 2)))
    return best[0], best[1], float(np.sum((cols["a"] * best[0] + cols["b"] * best[1] - target) ** 2))


def fit_roofline(observations: Sequence[Observation], *, per_layer: bool = True,
                 per_step: bool = True) -> Roofline:
    """The `Roofline` of least squared relative error over `observations` (efficiencies on GRID)."""
    if not observations:
        raise ValueError("nothing to fit")
    compute = np.array([o.compute_s for o in observations])
    memory = np.array([o.memory_s for o in observations])
    reduce = np.array([o.all_reduce_s for o in observations])
    layers = np.array([float(o.layers) for o in observations])
    measured = np.array([o.measured_s for o in observations])
    if np.any(measured <= 0):
        raise ValueError("measured times must be positive")
    best: tuple[float, Roofline] | None = None
    for eff_c in GRID:
        c = compute / eff_c
        for eff_m in GRID:
            gap = measured - np.maximum(c, memory / eff_m) - reduce
            a, b, sse = _fixed_costs(gap, layers, measured, per_layer, per_step)
            if best is None or sse < best[0]:
                best = (sse, Roofline(float(eff_c), float(eff_m), a, b))
    assert best is not None
    return best[1]
