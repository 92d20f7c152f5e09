#!/usr/bin/env python
"""Fit the roofline cost model's efficiencies and fixed costs on Splitwise's measured step times.

Source: ../shared/data/splitwise-sim/perf_model.csv beside the repository (or --csv PATH), from the public
simulator released with the Splitwise
paper (ISCA'24, Mutinifni/splitwise-sim, MIT licence): prompt_time (ms, the whole prompt phase of a batch) and
token_time (ms, one decode iteration averaged over token_size tokens) of Llama-2 70B (TP 2, 4, 8) and BLOOM-176B
(TP 8) measured on DGX-A100 (80 GB) and DGX-H100, five repetitions per point. None of the reproductions it
prices (EcoServe, Cronus) uses these numbers or these machines, so it is an independent source.

Every row gives two steps: its prefill (batch_size prompts of prompt_size tokens in one step) and its mean
decode iteration (batch_size items at a context of prompt_size + token_size / 2). Each is priced as the code
prices a TP instance (`planner.instance_cost`): `costmodel.peak_seconds` of the tp GPUs as one device, plus two
ring all-reduces per layer (`planner.all_reduce`) over the DGX's NVLink (`testnet.sim.provision.MACHINES`: 300
and 450 GB/s one direction, 5 us a message). Devices: `a100-80g` (312 TFLOP/s, 2,000 GB/s) and the H100 at its
dense FP16 figure (989.5; `planner.devices` keeps the sparse 1,979 that Helix's table prints), because the
devices the fit is applied to (A10, A30, A100, L20) carry dense figures. The power-capped H100 rows are left
out (a different device), and so are the rows of a batch whose prefill took less time than at half that batch
(Llama-2 70B at TP 2, batch 64: 802 ms against 6,639 ms at batch 32 on the A100, 363 against 2,399 on the
H100, and a faster decode too: a batch whose KV did not fit TP 2's memory, not a step of 64 prompts).
BLOOM-176B is a ModelSpec with BLOOM's shape (70 layers, hidden 14,336, 112 heads, no GQA); its two-matrix 4h
MLP is written as the gated MLP of the same weights (intermediate 8h/3 = 38,229).

    .venv/bin/python scripts/fit_roofline.py [--csv PATH]

prints the fit (both fixed costs, and each alone), and per (model, hardware, TP) the median and RMS relative
error of prefill and decode steps under the fit and under today's DEFAULT_ROOFLINE.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetnode.planner.all_reduce import tp_layer_s
from hetnode.planner.costmodel import DEFAULT_ROOFLINE, Roofline, peak_seconds
from hetnode.planner.devices import DEVICES, DeviceSpec
from hetnode.planner.model import ModelSpec, model_spec
from hetnode.planner.roofline_fit import Observation, fit_roofline, predict, relative_errors
from hetnode.testnet.sim.provision import MACHINES

# The whole measured table (every TP); the package ships only its TP-8 rows (planner/data/splitwise).
CSV = Path(__file__).resolve().parents[2] / "shared" / "data" / "splitwise-sim" / "perf_model.csv"
LINK_LATENCY_S = 5e-6  # provision.design_cluster's gpu_link latency

MODELS: dict[str, ModelSpec] = {
    "llama2-70b": model_spec("llama-70b"),
    "bloom-176b": ModelSpec("bloom-176b", 70, 14336, 38229, 112, 112, 250880),
}
HARDWARE: dict[str, tuple[DeviceSpec, float]] = {  # device, NVLink GB/s one direction
    "a100-80gb": (DEVICES["a100-80g"], MACHINES["8xa100-80g"].nvlink_gbps),
    "h100-80gb": (replace(DEVICES["h100"], fp16_tflops=989.5), MACHINES["8xh100"].nvlink_gbps),
}


def _point(row: dict[str, str], batch: int) -> tuple[str, ...]:
    return (row["model"], row["hardware"], row["tensor_parallel"], row["prompt_size"], str(batch), row["token_size"])


def _shrinks(rows: list[dict[str, str]]) -> set[tuple[str, ...]]:
    """Points whose mean prefill is faster than the same point's at half the batch."""
    times: dict[tuple[str, ...], list[float]] = defaultdict(list)
    for row in rows:
        times[_point(row, int(row["batch_size"]))].append(float(row["prompt_time"]))
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    return {k for k in mean if int(k[4]) > 1 and mean[k] < mean.get((*k[:4], str(int(k[4]) // 2), k[5]), 0.0)}


def _step(row: dict[str, str], new: int, context: int, pairs: int, measured_ms: float) -> Observation:
    """One measured step of `row`'s model on its hardware at its TP, priced as `InstanceCost.step_s` prices it."""
    model = MODELS[row["model"]]
    gpu, nvlink = HARDWARE[row["hardware"]]
    tp = int(row["tensor_parallel"])
    layers = model.num_layers
    compute, memory = peak_seconds(gpu.times(tp), model.shape, layers, new, context, attended_pairs=pairs)
    reduce = layers * tp_layer_s(tp, new, model.activation_bytes, nvlink * 1e9, LINK_LATENCY_S)
    return Observation(compute, memory, reduce, layers, measured_ms / 1000)


def observations(path: Path) -> dict[tuple[str, str, int, str], list[Observation]]:
    """(model, hardware, tp, "prefill" | "decode") -> its steps."""
    out: dict[tuple[str, str, int, str], list[Observation]] = defaultdict(list)
    with path.open() as f:
        rows = [row for row in csv.DictReader(f) if row["hardware"] in HARDWARE]
    dropped = _shrinks(rows)
    for row in rows:
        if _point(row, int(row["batch_size"])) in dropped:
            continue
        p, b, t = int(row["prompt_size"]), int(row["batch_size"]), int(row["token_size"])
        key = (row["model"], row["hardware"], int(row["tensor_parallel"]))
        out[(*key, "prefill")].append(_step(row, b * p, b * p, b * p * (p + 1) // 2, float(row["prompt_time"])))
        ctx = b * (p + t // 2)
        out[(*key, "decode")].append(_step(row, b, ctx, ctx, float(row["token_time"])))
    return out


def rms(xs: list[float]) -> float:
    return math.sqrt(sum(x * x for x in xs) / len(xs))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", type=Path, default=CSV, help=f"Splitwise's perf_model.csv (default: {CSV})")
    path = ap.parse_args().csv
    if not path.is_file():
        ap.error(f"no measured table at {path}: give --csv PATH (splitwise-sim's perf_model.csv)")
    groups = observations(path)
    every = [o for obs in groups.values() for o in obs]
    fits = {"both": fit_roofline(every), "per layer only": fit_roofline(every, per_step=False),
            "per step only": fit_roofline(every, per_layer=False)}
    print(f"{len(every)} steps from {path}")
    print(f"{'fit':16}{'eff_c':>7}{'eff_m':>7}{'layer ms':>10}{'step ms':>9}{'rms rel err':>13}")
    for name, r in [*fits.items(), ("DEFAULT (today)", DEFAULT_ROOFLINE)]:
        print(f"{name:16}{r.compute_efficiency:>7.2f}{r.memory_efficiency:>7.2f}{r.layer_fixed_s * 1e3:>10.4f}"
              f"{r.step_fixed_s * 1e3:>9.3f}{rms(relative_errors(r, every)):>13.3f}")
    fitted = fits["both"]
    print(f"\nfitted: {fitted}")
    print("\nrelative error (predicted / measured - 1), median and RMS, fitted | default")
    print(f"{'model':12}{'hardware':11}{'tp':>3}{'phase':>9}{'steps':>6}{'fitted med':>12}{'rms':>7}"
          f"{'default med':>13}{'rms':>7}")
    for (model, hw, tp, phase), obs in sorted(groups.items()):
        fe, de = relative_errors(fitted, obs), relative_errors(DEFAULT_ROOFLINE, obs)
        print(f"{model:12}{hw:11}{tp:>3}{phase:>9}{len(obs):>6}{statistics.median(fe):>12.3f}{rms(fe):>7.3f}"
              f"{statistics.median(de):>13.3f}{rms(de):>7.3f}")
    print("\ndecode, batch 1, prompt 512, 128 tokens (ms): measured / fitted / default")
    for (model, hw, tp, phase), obs in sorted(groups.items()):
        if phase == "decode":
            o = obs[0]
            print(f"  {model} {hw} TP{tp}: {o.measured_s * 1e3:.1f} / {predict_ms(fitted, o):.1f} / "
                  f"{predict_ms(DEFAULT_ROOFLINE, o):.1f}")
    return 0


def predict_ms(roofline: Roofline, o: Observation) -> float:
    return predict(roofline, o) * 1e3


if __name__ == "__main__":
    raise SystemExit(main())
