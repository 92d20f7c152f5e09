"""`hetnode sim --placement cronus` (and dp, pp, disagg-hl, disagg-lh): Cronus §5's designs on a two-GPU cluster.

    hetnode sim --cluster cronus-a100-a10 --model llama3-8b --placement cronus --offline
    hetnode sim --cluster cronus-a100-a30 --model qwen2-7b --placement dp --rate 4

The cluster file names two nodes; the one with more FP16 FLOP/s is the high-end GPU. Requests are the trace's
first `--first` (1000, as §5.1), unfiltered unless asked; `--offline` sends them all at time 0 (§5.2's
maximum throughput), `--rate R` at a fixed interval of 1/R seconds (§5.1). The run ends when every request has.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.devices import parse_device
from hetnode.planner.model import ModelSpec
from hetnode.testnet.sim.pair_designs import DESIGNS, PairResult, PairSetup, simulate_pair
from hetnode.testnet.sim.workload import Trace

DEFAULT_REQUESTS = 1000


def pair_setup(cluster: ClusterSpec, model: ModelSpec) -> PairSetup:
    if len(cluster.nodes) != 2:
        raise ConfigError(f"Cronus's designs run on a pair of GPUs; cluster {cluster.name} has {len(cluster.nodes)} "
                          "nodes", key="--cluster")
    a, b = cluster.nodes
    da, db = parse_device(a.device), parse_device(b.device)
    high, low = (da, db) if da.fp16_tflops >= db.fp16_tflops else (db, da)
    link = cluster.link(a.name, b.name)
    return PairSetup(high, low, model, link_gbps=link.bandwidth_mbps / 1e3, link_latency_s=link.latency_ms / 1e3)


def run_pair(args: argparse.Namespace, cluster: ClusterSpec, model: ModelSpec, trace: Trace) -> int:
    n = args.first or DEFAULT_REQUESTS
    if len(trace) < n:
        raise ConfigError(f"the trace has {len(trace)} requests, fewer than the {n} asked for", key="--first")
    if not args.offline and args.rate is None:
        raise ConfigError(f"--placement {args.method} needs --offline (all requests at once) or --rate R",
                          key="--rate")
    arrivals = [0.0] * n if args.offline else [i / args.rate for i in range(n)]
    setup = pair_setup(cluster, model)
    try:
        result = simulate_pair(args.method, setup, trace.inputs[:n], trace.outputs[:n], arrivals)
    except (ValueError, RuntimeError) as exc:
        raise ConfigError(str(exc)) from exc
    summary = summarize(result, setup)
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(format_pair(summary), end="")
    return 0


def summarize(result: PairResult, setup: PairSetup) -> dict[str, Any]:
    return {
        "design": result.design, "high": setup.high.name, "low": setup.low.name, "model": setup.model.name,
        "requests": len(result.requests), "throughput_rps": result.throughput, "makespan_s": result.makespan_s,
        "ttft_s": {"p50": result.ttft(0.5), "p99": result.ttft(0.99)},
        "tbt_s": {"p50": result.tbt(0.5), "p99": result.tbt(0.99)},
        "busy": result.utilization(), "decisions": result.decisions,
        "mean_split": sum(result.splits) / len(result.splits) if result.splits else None,
    }


def format_pair(s: dict[str, Any]) -> str:
    split = "" if s["mean_split"] is None else f"; mean partial prefill {s['mean_split']:.0f} tokens"
    return "\n".join([
        f"design       {s['design']} on {s['high']} + {s['low']}, {s['model']}",
        f"requests     {s['requests']} in {s['makespan_s']:.1f} simulated s: {s['throughput_rps']:.2f} requests/s",
        f"TTFT (s)     p50 {s['ttft_s']['p50']:.3f}, p99 {s['ttft_s']['p99']:.3f}",
        f"TBT (ms)     p50 {s['tbt_s']['p50'] * 1e3:.1f}, p99 {s['tbt_s']['p99'] * 1e3:.1f}",
        "busy         " + ", ".join(f"{k} {v:.0%}" for k, v in s["busy"].items()) + split,
    ]) + "\n"


__all__ = ["DESIGNS", "pair_setup", "run_pair"]
