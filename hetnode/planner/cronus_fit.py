"""Cronus's predictors fitted on the cost model: the balancer's coefficients for a PPI and a CPI device.

Cronus fits Eq. 2 and Eq. 3 by linear regression on profiled runs (§4.4). Here the "runs" are the roofline cost
model's step times (`planner.costmodel.step_time`) of the device holding the whole model: prefills of 64 to
8,192 tokens alone for the PPI, and CPI iterations of B tokens made of one prefill chunk at prefill contexts of
up to 8,192 tokens beside 0 to 64 decodes of up to 4,096 tokens of context each. A measured table can take
their place when one exists for the device.
"""

from __future__ import annotations

import statistics

from hetnode.planner.costmodel import DEFAULT_ROOFLINE, Roofline, step_time
from hetnode.planner.devices import DeviceSpec
from hetnode.planner.model import ModelSpec
from hetnode.policy.cronus import ChunkedIteration, LinearPrefill


def fit_partial_prefill(device: DeviceSpec, model: ModelSpec, roofline: Roofline = DEFAULT_ROOFLINE) -> LinearPrefill:
    shape = model.shape
    xs = [64 * 2**i for i in range(8)]  # 64 .. 8192 tokens
    ys = [step_time(device, shape, model.num_layers, n, n, attended_pairs=n * (n + 1) // 2, roofline=roofline)
          for n in xs]
    fit = statistics.linear_regression(xs, ys)
    return LinearPrefill(fit.slope, max(0.0, fit.intercept))


def fit_chunked_iteration(device: DeviceSpec, model: ModelSpec, max_batch_tokens: int,
                          roofline: Roofline = DEFAULT_ROOFLINE) -> ChunkedIteration:
    """Eq. 3 by least squares over iterations of `max_batch_tokens` tokens (a chunk plus the decodes)."""
    shape = model.shape
    rows: list[tuple[float, float, float]] = []
    for decodes in (0, 8, 32, 64):
        chunk = max(1, max_batch_tokens - decodes)
        for prefill_context in (chunk, 1024, 2048, 4096, 8192):
            if prefill_context < chunk:
                continue
            for per_decode in (256, 1024, 4096):
                decode_context = decodes * per_decode
                pairs = chunk * prefill_context + decode_context
                t = step_time(device, shape, model.num_layers, chunk + decodes, prefill_context + decode_context,
                              attended_pairs=pairs, roofline=roofline)
                rows.append((prefill_context, decode_context, t))
    return ChunkedIteration(*_least_squares(rows))


def _least_squares(rows: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    """(a, c, b) minimizing sum (a x + c z + b - y)^2 over rows (x, z, y): the 3x3 normal equations."""
    n = len(rows)
    sx = sum(x for x, _, _ in rows)
    sz = sum(z for _, z, _ in rows)
    sy = sum(y for _, _, y in rows)
    sxx = sum(x * x for x, _, _ in rows)
    szz = sum(z * z for _, z, _ in rows)
    sxz = sum(x * z for x, z, _ in rows)
    sxy = sum(x * y for x, _, y in rows)
    szy = sum(z * y for _, z, y in rows)
    m = [[sxx, sxz, sx, sxy], [sxz, szz, sz, szy], [sx, sz, float(n), sy]]
    for col in range(3):  # Gauss-Jordan with partial pivoting
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        if m[col][col] == 0:
            raise ValueError("the fit's points do not determine its coefficients")
        for r in range(3):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col], strict=True)]
    a, c, b = (m[i][3] / m[i][i] for i in range(3))
    return a, c, b
