#!/usr/bin/env python
"""EcoServe (§4.2-4.3) in simulation: every ratio the paper states, ours beside it.

What runs: the instance simulator (`hetnode.testnet.sim.padg`, the policies the runtime shares) on EcoServe's two
testbeds (§4.1-4.2): the L20 cluster (hetnode/testnet/clusters/ecoserve-l20.toml: 8 nodes x 8 L20-48GB, PCIe inside
a node, 10 Gb/s between nodes), LLaMA-30B and CodeLlama-34B at TP=4 (8 instances, one per node: 32 GPUs) and
Qwen2-72B at TP=8 (4 instances); and the A800 cluster (ecoserve-a800.toml: 2 nodes x 8 A800-80GB, PCIe only, 25
Gb/s RoCE between them), LLaMA-30B and CodeLlama-34B at TP=2 (8 instances) and Qwen2-72B at TP=4 (4 instances),
16 GPUs. Each step is priced by `planner/instance_cost.py` (roofline of the TP group from the GPU's data sheet,
two ring all-reduces per layer over PCIe). Designs (padg.py): EcoServe (PaDG: temporal disaggregation, rolling
activation by Algorithms 1-2), vLLM-like NoDG (separate batching, prefill first), Sarathi-like NoDG (chunked
prefill, 512-token budget, decode first), DistServe-like FuDG (prefill and decode instances of the model's TP in
pairs on the same nodes, KV over the node's PCIe; intra-node FuDG cannot place two TP=8 instances on a node of 8,
so on the L20 cluster DistServe runs Qwen2-72B at TP=4, which holds its 145 GB of weights in 192 GB),
Mooncake-like FuDG (the instances spread over the nodes as §4.2 deploys them, KV over the NICs; the P/D split
chosen as the best of 2/6, 4/4 and 6/2 per workload, as §4.1 does).

Workloads: Table 4's datasets cannot be downloaded, so their lengths are synthesized to Table 4's means and
medians (`hetnode.testnet.sim.synthetic`: log-normal, LongBench's inputs a Beta), with Table 4's SLOs; Poisson
arrivals (§4.1). `--azure` adds the Azure conversation trace (lengths from the trace, ShareGPT's SLOs) as a
second stand-in for ShareGPT.

Goodput at P50/P90/P99 (§4.1's metric): the highest request rate whose SLO attainment (EcoServe's TTFT, which
includes the wait for the decode phase, and TPOT both within the SLOs) is at least 50/90/99%, found on a rate
grid of 15% steps: from a low start rate down until attainment reaches 99% (so that every crossing lies inside
the grid), then up until it falls under 50%, interpolated between grid points. Ratios are EcoServe / baseline
- 1 as the paper states them ("+83.76%"), averaged over the workloads run (every testbed, model and dataset:
§4.2 averages over its full combinations), and per testbed as §4.2 states them. "Same winner": both on the same
side of 0; "within 25%": |ours / paper - 1| <= 0.25 on (1 + ratio).

Scaling: Fig. 9 (static): CodeLlama-34B at TP=4 on ShareGPT, 1, 2 and 4 instances in one macro-instance, P90
goodput; the paper's 1 -> 4 is 5.6x. Fig. 10 (dynamic): CodeLlama-34B, ShareGPT, 8 instances to start, N_l = 4,
N_u = 16, the rate rising from 20 to 50 req/s in steps (the paper: every 2 minutes; --quick: shorter), SLO
attainment per 30 s window and the instances added.

    .venv/bin/python scripts/reproduce_ecoserve.py [--quick] [--testbeds l20,a800] [--models ...]
        [--datasets ...] [--azure] [--duration S] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from hetnode.planner.costmodel import ROOFLINES, Roofline
from hetnode.planner.model import model_spec
from hetnode.policy.ecoserve import Slos
from hetnode.testnet.sim.padg import PadgOptions, simulate_instances
from hetnode.testnet.sim.synthetic import TABLE4, table4_trace
from hetnode.testnet.sim.workload import Trace, load_trace, poisson

PERCENTILES = (0.5, 0.9, 0.99)
LATENCIES = ("ttft_p50", "ttft_p90", "ttft_eco_p50", "ttft_eco_p90", "tpot_p50", "tpot_p90")


@dataclass(frozen=True)
class Testbed:
    """One of §4.1's clusters as §4.2 deploys each model on it."""

    device: str
    nodes: int  # the nodes §4.2's instances are spread over
    gpus_per_node: int
    nic_gbps: float  # between nodes
    models: dict[str, tuple[int, int]] = field(default_factory=dict)  # model -> (TP, instances)

    def per_host(self, instances: int) -> int:
        return -(-instances // self.nodes)


TESTBEDS = {
    # 32 of the 64 L20s, one instance per node (§4.2: "a single instance per node" for MoonCake's sake).
    "l20": Testbed("l20", nodes=8, gpus_per_node=8, nic_gbps=10.0,
                   models={"llama-30b": (4, 8), "codellama-34b": (4, 8), "qwen2-72b": (8, 4)}),
    # Both A800 nodes' 16 GPUs (§4.2: TP=2 with 8 instances, Qwen2-72B TP=4 with 4), 25 Gb/s RoCE between them.
    "a800": Testbed("a800", nodes=2, gpus_per_node=8, nic_gbps=25.0,
                    models={"llama-30b": (2, 8), "codellama-34b": (2, 8), "qwen2-72b": (4, 4)}),
}
MODELS = TESTBEDS["l20"].models
BASELINES = ("vllm", "sarathi", "distserve", "mooncake")
# §4.2: average goodput improvement of EcoServe over each baseline, at P50 and P90.
PAPER = {
    0.5: {"vllm": 0.3649, "sarathi": 0.1982, "distserve": 1.8073, "mooncake": 1.9462},
    0.9: {"vllm": 0.8376, "sarathi": 0.7197, "distserve": 1.9241, "mooncake": 2.1822},
}
PAPER_MODELS_P90 = {"llama-30b": (0.6500, 5.0767), "codellama-34b": (0.8330, 1.2545), "qwen2-72b": (0.8530, 0.8361)}
PAPER_TESTBEDS_P90 = {"a800": (0.7141, 2.8578), "l20": (0.8433, 1.2486)}  # §4.2, "Comparison Across Clusters"
PAPER_DATASETS_P90 = {"alpaca": (0.1044, 0.7480), "sharegpt": (0.2060, 3.6310), "longbench": (2.0257, 1.6442)}
PAPER_FIG9 = 5.6  # CodeLlama-34B, 1 -> 4 instances, P90 goodput


def options(design: str, model: str, testbed: Testbed = TESTBEDS["l20"], **kw: Any) -> PadgOptions:
    tp, instances = testbed.models[model]
    base = PadgOptions(design=design, device=testbed.device, tp=tp, instances=instances,
                       per_host=testbed.per_host(instances), nic_gbps=testbed.nic_gbps)
    if design == "distserve":
        # Prefill and decode instances in pairs on a node, on as many GPUs as the others use; a node of 8 holds
        # no pair of TP=8 instances, so those run at TP=4.
        dtp = tp if testbed.gpus_per_node // tp >= 2 else tp // 2
        count = tp * instances // dtp
        base = replace(base, tp=dtp, instances=count, per_host=testbed.gpus_per_node // dtp)
    return replace(base, **kw)


def attainment(model: str, trace: Trace, slos: Slos, opts: PadgOptions, rate: float, duration: float,
               seed: int) -> float:
    w = poisson(rate, lengths=trace, duration_s=duration, seed=seed)
    return simulate_instances(model_spec(model), w, opts, duration_s=duration, warmup_s=duration / 6,
                              slos=slos).attainment()


def goodput(model: str, trace: Trace, slos: Slos, opts: PadgOptions, duration: float, seed: int,
            start: float) -> dict[str, Any]:
    """P50/P90/P99 goodput (req/s) from the rate grid (`grid`), and the grid's points."""
    points = grid(lambda rate: attainment(model, trace, slos, opts, rate, duration, seed), start)
    out: dict[str, Any] = {"points": points}
    for p in PERCENTILES:
        out[f"p{round(p * 100)}"] = crossing(points, p)
    return out


def grid(attain: Callable[[float], float], start: float, step: float = 1.15,
         most: int = 30) -> list[tuple[float, float]]:
    """(rate, attainment) points in rising rate, 15% apart: down from `start` until attainment reaches the
    highest percentile asked (a start already past it would leave that crossing outside the grid, and the
    goodput 0 or one coarse step), at most 16x lower, then up until it falls under the lowest."""
    points = [(start, attain(start))]
    while points[0][1] < max(PERCENTILES) and points[0][0] > start / 16 and len(points) < most:
        rate = points[0][0] / step
        points.insert(0, (rate, attain(rate)))
    while points[-1][1] >= min(PERCENTILES) and len(points) < most:
        rate = points[-1][0] * step
        points.append((rate, attain(rate)))
    return points


def crossing(points: list[tuple[float, float]], p: float) -> float:
    """The rate where attainment first falls under p, interpolated; 0 if even the lowest rate misses it."""
    if points[0][1] < p:
        return 0.0
    for (r0, a0), (r1, a1) in itertools.pairwise(points):
        if a1 < p:
            return r0 + (r1 - r0) * (a0 - p) / (a0 - a1) if a0 > a1 else r0
    return points[-1][0]


def start_rate(model: str, trace: Trace, roofline: Roofline, testbed: Testbed = TESTBEDS["l20"]) -> float:
    """A low rate to start the grid at: a fifth of what the instances could prefill alone."""
    from hetnode.testnet.sim.padg import instance_cost

    tp, instances = testbed.models[model]
    cost = instance_cost(model_spec(model), PadgOptions(device=testbed.device, tp=tp, roofline=roofline))
    mean_in = sum(trace.inputs) / len(trace)
    mean_out = sum(trace.outputs) / len(trace)
    per_request = cost.prefill_s(round(mean_in)) + mean_out * cost.step_s((), [round(mean_in + mean_out)] * 32) / 32
    return max(0.05, 0.2 * instances / per_request)


def ratio_row(name: str, ours: float, paper: float) -> dict[str, Any]:
    same = (ours > 0) == (paper > 0)
    within = abs((1 + ours) / (1 + paper) - 1) <= 0.25
    return {"row": name, "ours": ours, "paper": paper, "same_winner": same, "within_25": within}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--testbeds", default=",".join(TESTBEDS), help="comma-separated subset of l20,a800 (§4.1)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--datasets", default=",".join(TABLE4))
    ap.add_argument("--azure", action="store_true", help="also the Azure conversation trace (ShareGPT's SLOs)")
    ap.add_argument("--duration", type=float, default=120.0, help="simulated seconds per run (a sixth warm-up)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-scaling", action="store_true", help="skip Fig. 9 and Fig. 10")
    ap.add_argument("--quick", action="store_true", help="a smoke run: one model, ShareGPT, short runs")
    ap.add_argument("--deploy", action="append", default=[], metavar="MODEL=TPxN",
                    help="run MODEL at TP with N instances instead of §4.2's (e.g. qwen2-72b=4x8)")
    ap.add_argument("--explain-at", default=None, metavar="[TESTBED/]MODEL/DATASET@RATE",
                    help="only the where-the-time-goes runs, at this rate (skips the goodput search; testbed l20 "
                    "unless named)")
    ap.add_argument("--roofline", choices=sorted(ROOFLINES), default="default",
                    help="the cost model's calibration (planner.costmodel.ROOFLINES; fitted: on Splitwise's "
                    "measured step times, scripts/fit_roofline.py)")
    ap.add_argument("--json", default=None, metavar="OUT")
    args = ap.parse_args()
    for tb in args.testbeds.split(","):
        if tb not in TESTBEDS:
            ap.error(f"unknown testbed {tb!r}; known: {', '.join(TESTBEDS)}")
    for spec in args.deploy:  # on the L20 cluster
        name, _, shape = spec.partition("=")
        tp, _, count = shape.partition("x")
        MODELS[name] = (int(tp), int(count))
    if args.explain_at:
        key, _, rate = args.explain_at.partition("@")
        fake = {key: {"vllm": {"p90": float(rate), "points": [(float(rate), 1.0)]}}}
        explain(args, fake, ("ecoserve", *BASELINES))
        return
    if args.quick:
        args.testbeds, args.models, args.datasets, args.duration = "l20", "codellama-34b", "sharegpt", 20.0
    t0 = time.time()
    workloads: list[tuple[str, Trace, Slos]] = []
    for d in args.datasets.split(","):
        row = TABLE4[d]
        workloads.append((d, table4_trace(d, n=400 if args.quick else 4000, seed=args.seed),
                          Slos(row.ttft_s, row.tpot_s)))
    if args.azure:
        row = TABLE4["sharegpt"]
        workloads.append(("azure-conv", load_trace("conv"), Slos(row.ttft_s, row.tpot_s)))
    designs = ("ecoserve", *BASELINES) if not args.quick else ("ecoserve", "vllm", "mooncake")
    results: dict[str, Any] = {"goodput": {}, "settings": vars(args)}
    for tb in args.testbeds.split(","):
        testbed = TESTBEDS[tb]
        for model in args.models.split(","):
            for name, trace, slos in workloads:
                key = f"{tb}/{model}/{name}"
                results["goodput"][key] = workload_goodputs(key, testbed, model, trace, slos, designs, args, t0)
    results["ratios"] = ratios(results["goodput"], designs)
    results["explain"] = explain(args, results["goodput"], designs)
    if not args.no_scaling:
        results["fig9"] = fig9(args)
        results["fig10"] = fig10(args)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print(f"\n{time.time() - t0:.0f} s")


def workload_goodputs(key: str, testbed: Testbed, model: str, trace: Trace, slos: Slos, designs: tuple[str, ...],
                      args: argparse.Namespace, t0: float) -> dict[str, Any]:
    """Every design's goodputs on one testbed, model and workload."""
    roofline = ROOFLINES[args.roofline]
    start = start_rate(model, trace, roofline, testbed)
    instances = testbed.models[model][1]
    cell: dict[str, Any] = {}
    for design in designs:
        if design == "mooncake":  # the best P/D split (§4.1), by P90 goodput
            tries = {}
            for p in (2, 4, 6) if not args.quick else (4,):
                opts = options(design, model, testbed, prefill=p * instances // 8, roofline=roofline)
                tries[p] = goodput(model, trace, slos, opts, args.duration, args.seed, start)
            best = max(tries, key=lambda p: tries[p]["p90"])
            cell[design] = {**tries[best], "prefill_of_8": best}
        else:
            cell[design] = goodput(model, trace, slos, options(design, model, testbed, roofline=roofline),
                                   args.duration, args.seed, start)
        print(f"{key:34} {design:10} P50 {cell[design]['p50']:6.2f}  P90 {cell[design]['p90']:6.2f}  "
              f"P99 {cell[design]['p99']:6.2f} req/s   ({time.time() - t0:.0f} s)", flush=True)
    return cell


def improvement(cell: dict[str, Any], base: str, p: str) -> float | None:
    eco, other = cell["ecoserve"][p], cell[base][p]
    if other <= 0:
        return None  # the baseline never meets the attainment: no finite ratio (the paper drops such cells)
    return float(eco / other - 1)


def mean(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals else None


def ratios(goodputs: dict[str, Any], designs: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for p, paper in PAPER.items():
        tag = f"p{round(p * 100)}"
        for base in designs[1:]:
            ours = mean([improvement(c, base, tag) for c in goodputs.values()])
            if ours is not None:
                rows.append(ratio_row(f"{tag} EcoServe vs {base} (mean over workloads)", ours, paper[base]))
    nodg = [b for b in ("vllm", "sarathi") if b in designs]
    fudg = [b for b in ("distserve", "mooncake") if b in designs]
    # §4.2's P90 improvements over NoDG and FuDG, per testbed, per model and per dataset (the key's three parts).
    for i, stated in enumerate((PAPER_TESTBEDS_P90, PAPER_MODELS_P90, PAPER_DATASETS_P90)):
        for name, (p_nodg, p_fudg) in stated.items():
            cells = [c for k, c in goodputs.items() if k.split("/")[i] == name]
            for group, paper_value, label in ((nodg, p_nodg, "NoDG"), (fudg, p_fudg, "FuDG")):
                ours = mean([improvement(c, b, "p90") for c in cells for b in group])
                if ours is not None:
                    rows.append(ratio_row(f"p90 {name}: EcoServe vs {label}", ours, paper_value))
    return rows


def explain(args: argparse.Namespace, goodputs: dict[str, Any], designs: tuple[str, ...]) -> dict[str, Any]:
    """Where the time goes: every design at one rate (vLLM-like's P90 goodput on the first workload run), the
    share of instance time in each kind of step, the items per step, and the latency percentiles."""
    key = next(iter(goodputs))
    *where, model, name = key.split("/")
    testbed = TESTBEDS[where[0] if where else "l20"]
    rate = goodputs[key]["vllm"]["p90"] or goodputs[key]["vllm"]["points"][0][0]
    row = TABLE4.get(name, TABLE4["sharegpt"])
    trace = table4_trace(name, n=400 if args.quick else 4000, seed=args.seed) if name in TABLE4 else load_trace("conv")
    out: dict[str, Any] = {"workload": key, "rate": rate, "designs": {}}
    print(f"\nwhere the time goes, {key} at {rate:.2f} req/s:")
    for design in designs:
        w = poisson(rate, lengths=trace, duration_s=args.duration, seed=args.seed)
        roofline = ROOFLINES[args.roofline]
        opts = (options(design, model, testbed, prefill=testbed.models[model][1] // 2, roofline=roofline)
                if design == "mooncake" else options(design, model, testbed, roofline=roofline))
        res = simulate_instances(model_spec(model), w, opts, duration_s=args.duration, warmup_s=args.duration / 6,
                                 slos=Slos(row.ttft_s, row.tpot_s))
        summary = res.summary()
        total = sum(c["seconds"] for c in res.steps.values()) or 1.0
        cell = {"attainment": summary["slo_attainment"],
                "steps": {k: {"time_share": c["seconds"] / total, "mean_items": c["mean_items"],
                              "mean_step_s": c["seconds"] / c["steps"]} for k, c in res.steps.items()},
                **{k: math.nan if summary[k] is None else summary[k] for k in LATENCIES}}
        out["designs"][design] = cell
        shares = ", ".join(f"{k} {c['time_share']:.0%} of time, {c['mean_items']:.1f} items/step, "
                           f"{c['mean_step_s'] * 1000:.0f} ms/step" for k, c in cell["steps"].items())
        print(f"  {design:9} attainment {cell['attainment']:.3f}; TTFT p90 {cell['ttft_p90']:.2f} s, EcoServe's "
              f"TTFT p90 {cell['ttft_eco_p90']:.2f} s, TPOT p50/p90 {cell['tpot_p50'] * 1000:.0f}/"
              f"{cell['tpot_p90'] * 1000:.0f} ms; {shares}", flush=True)
    return out


def fig9(args: argparse.Namespace) -> dict[str, Any]:
    """Static scaling: P90 goodput of 1, 2, 4 instances (CodeLlama-34B, TP=4, ShareGPT), EcoServe and vLLM."""
    row = TABLE4["sharegpt"]
    trace, slos = table4_trace("sharegpt", n=400 if args.quick else 4000, seed=args.seed), Slos(row.ttft_s, row.tpot_s)
    out: dict[str, Any] = {}
    for design in ("ecoserve", "vllm"):
        per: dict[int, float] = {}
        for n in (1, 2, 4):
            opts = PadgOptions(design=design, tp=4, instances=n, per_host=1, roofline=ROOFLINES[args.roofline])
            start = start_rate("codellama-34b", trace, opts.roofline) * n / 8
            per[n] = goodput("codellama-34b", trace, slos, opts, args.duration, args.seed, start)["p90"]
        out[design] = {"p90": per, "x4_over_x1": per[4] / per[1] if per[1] > 0 else None}
        print(f"fig9 {design:9} P90 goodput 1/2/4 instances: {per[1]:.2f} {per[2]:.2f} {per[4]:.2f} req/s", flush=True)
    return out


def fig10(args: argparse.Namespace) -> dict[str, Any]:
    """Dynamic scaling: 8 instances to start, the rate stepping 20 -> 50 req/s, mitosis adding instances."""
    step = 15.0 if args.quick else 120.0
    rates = (20.0, 30.0, 40.0, 50.0)
    row = TABLE4["sharegpt"]
    trace = table4_trace("sharegpt", n=400 if args.quick else 4000, seed=args.seed)
    arrivals: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    for k, rate in enumerate(rates):
        w = poisson(rate, lengths=trace, duration_s=step, seed=args.seed + k)
        arrivals += [k * step + t for t in w.arrivals]
        inputs += w.inputs
        outputs += w.outputs
    from hetnode.testnet.sim.workload import Workload

    workload = Workload("fig10", tuple(inputs), tuple(outputs), tuple(arrivals))
    opts = PadgOptions(design="ecoserve", tp=4, instances=8, max_instances=16, n_lower=4, n_upper=16,
                       window_s=30.0, drain_s=120.0, roofline=ROOFLINES[args.roofline])
    duration = step * len(rates)
    result = simulate_instances(model_spec("codellama-34b"), workload, opts, duration_s=duration, warmup_s=0.0,
                                slos=Slos(row.ttft_s, row.tpot_s))
    windows = []
    for w0 in range(0, int(duration), 30):
        reqs = [r for r in result.requests if w0 <= r.arrival < w0 + 30]
        met = sum(r.meets(result.slos) for r in reqs) / len(reqs) if reqs else math.nan
        windows.append({"t": w0, "rate": rates[min(len(rates) - 1, int(w0 // step))], "attainment": met})
    print("fig10 windows: " + " ".join(f"{w['t']}s:{w['attainment']:.2f}" for w in windows))
    print("fig10 scaling: " + " ".join(f"{e['t']:.0f}s +{e['instance']} {e['sizes']}" for e in result.scaling))
    return {"windows": windows, "scaling": result.scaling, "final_instances": 8 + sum(
        1 if e["action"] == "add" else -1 for e in result.scaling)}


def report(results: dict[str, Any]) -> None:
    print("\nEcoServe's improvement in goodput, ours beside the paper's (EcoServe / baseline - 1)")
    print(f"{'row':50} {'ours':>8} {'paper':>8}  same winner  within 25%")
    for r in results["ratios"]:
        print(f"{r['row']:50} {r['ours']:>+8.1%} {r['paper']:>+8.1%}  {r['same_winner']!s:>11}  "
              f"{r['within_25']!s:>10}")
    if "fig9" in results:
        x = results["fig9"]["ecoserve"]["x4_over_x1"]
        v = results["fig9"]["vllm"]["x4_over_x1"]
        print(f"\nFig. 9: EcoServe 1 -> 4 instances P90 goodput x{x if x is None else round(x, 2)} "
              f"(paper x{PAPER_FIG9}); vLLM-like x{v if v is None else round(v, 2)}")
    if "fig10" in results:
        f = results["fig10"]
        print(f"Fig. 10: {len(f['scaling'])} scaling events, {f['final_instances']} instances at the end")


if __name__ == "__main__":
    main()
