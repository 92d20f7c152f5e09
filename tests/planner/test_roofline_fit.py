"""The roofline fit (planner/roofline_fit.py, scripts/fit_roofline.py): it recovers a roofline that made the
data, and on Splitwise's measured rows it prices them, drops the rows that cannot be one step, and beats the
uncalibrated default."""

from __future__ import annotations

import importlib.util
import itertools
import sys
from pathlib import Path
from types import ModuleType

import pytest

from hetnode.planner.costmodel import DEFAULT_ROOFLINE, Roofline
from hetnode.planner.roofline_fit import Observation, fit_roofline, predict, relative_errors

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fit_roofline.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fit_roofline", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fit_roofline"] = module
    spec.loader.exec_module(module)
    return module


def synthetic(truth: Roofline) -> list[Observation]:
    out = []
    for compute, memory, layers in itertools.product((0.001, 0.02, 0.3), (0.004, 0.05), (12, 40, 80)):
        o = Observation(compute, memory, 0.1 * compute, layers, 1.0)
        out.append(Observation(compute, memory, o.all_reduce_s, layers, predict(truth, o)))
    return out


def test_the_fit_recovers_the_roofline_that_made_the_data() -> None:
    truth = Roofline(compute_efficiency=0.37, memory_efficiency=0.82, layer_fixed_s=3e-4, step_fixed_s=0.004)
    fit = fit_roofline(synthetic(truth))
    assert (fit.compute_efficiency, fit.memory_efficiency) == (0.37, 0.82)
    assert (fit.layer_fixed_s, fit.step_fixed_s) == pytest.approx((3e-4, 0.004), rel=1e-6)
    assert max(map(abs, relative_errors(fit, synthetic(truth)))) < 1e-9


def test_fixed_costs_stay_non_negative_and_may_be_left_out() -> None:
    truth = Roofline(compute_efficiency=0.5, memory_efficiency=0.5, layer_fixed_s=5e-4)
    assert fit_roofline(synthetic(truth), per_layer=False).layer_fixed_s == 0
    fast = [Observation(o.compute_s, o.memory_s, o.all_reduce_s, o.layers, o.measured_s * 0.5)
            for o in synthetic(Roofline(0.5, 0.5))]  # faster than any roofline at 0.5 with no fixed cost
    fit = fit_roofline(fast)
    assert fit.layer_fixed_s >= 0 and fit.step_fixed_s >= 0 and fit.compute_efficiency == 1.0


# Eight rows of Splitwise's perf_model.csv (Llama-2 70B on DGX-A100; ms), one repetition each, and a batch-64
# row at TP 2 whose prefill is faster than at batch 32 (a failed run).
HEADER = ("model,hardware,prompt_size,batch_size,token_size,peak_power,average_power,prompt_time,token_time,"
          "e2e_time,tensor_parallel")
ROWS = """\
llama2-70b,a100-80gb,512,1,128,1,0.7,196.2532,54.8795,7169,2
llama2-70b,a100-80gb,8192,1,128,1,0.7,2974.35,57.155,1,2
llama2-70b,a100-80gb,512,32,128,1,0.7,6638.89,72.092,1,2
llama2-70b,a100-80gb,512,64,128,1,0.7,802.006,67.295,1,2
llama2-70b,a100-80gb,512,1,128,1,0.7,94.4149,44.843,1,8
llama2-70b,a100-80gb,4096,1,128,1,0.7,634.354,46.565,1,8
llama2-70b,a100-80gb,512,16,128,1,0.7,1973.75,50.435,1,8
llama2-70b,a100-80gb,128,1,128,1,0.7,63.7723,42.164,1,4
llama2-70b,a100-80gb,2048,1,128,1,0.7,402.211,44.982,1,4
"""


def test_the_script_fits_splitwise_rows_and_drops_a_batch_that_was_not_one_step(tmp_path: Path) -> None:
    script = load_script()
    csv = tmp_path / "perf_model.csv"
    csv.write_text(HEADER + "\n" + ROWS)
    groups = script.observations(csv)
    assert sorted(groups) == [("llama2-70b", "a100-80gb", tp, phase) for tp in (2, 4, 8)
                              for phase in ("decode", "prefill")]
    assert len(groups[("llama2-70b", "a100-80gb", 2, "prefill")]) == 3  # the batch-64 row is gone
    decode = groups[("llama2-70b", "a100-80gb", 8, "decode")][0]
    assert decode.measured_s == pytest.approx(0.044843) and decode.layers == 80
    # 138 GB of weights over 8 x 2,000 GB/s: 8.6 ms at peak; 14 ring steps x 160 all-reduces x 5 us: >= 11 ms.
    assert decode.memory_s == pytest.approx(0.0086, rel=0.02) and decode.all_reduce_s > 0.0112
    every = [o for obs in groups.values() for o in obs]
    fit = fit_roofline(every)
    err = relative_errors(fit, every)
    assert sum(e * e for e in err) / len(err) < 0.25**2  # (batched prefills run slower than one prompt's rate)
    assert sum(e * e for e in err) < 0.5 * sum(e * e for e in relative_errors(DEFAULT_ROOFLINE, every))
    # A decode step is mostly fixed cost: what does not shrink with TP (45 ms at TP 8 against 8.6 ms of weights).
    assert fit.layer_fixed_s * 80 + fit.step_fixed_s > 0.01
