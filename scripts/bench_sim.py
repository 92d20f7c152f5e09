#!/usr/bin/env python
"""Simulator speed: simulated requests per wall-clock second, on Helix's 42-node cluster serving LLaMA-2 70B.

The scenario is the issue's target: hetnode/testnet/clusters/helix-hetero.toml (Helix §6.5's 42 nodes of 7 GPU
types), LLaMA-2 70B with Helix's measured profiles, a plan from the runtime's planner (`--method`, default
helix; or a plan JSON from `hetnode plan --json` with `--plan`), and 30 minutes of the Azure conversation trace
(Helix's length filter) replayed online at `--rate` requests/s (default: Helix's online rate, 75% of the
peak in requests of the trace's mean length; the peak measured by an untimed offline run, or with
`--peak maxflow` the plan's max flow), 30 s of warm-up, IWRR scheduling, then the drain.
Only `simulate` is timed (not planning or loading the trace): wall time and the CPU time of this process,
against the target of 60 s on one core. `--cprofile N` also prints the N functions with the most own time.

    .venv/bin/python scripts/bench_sim.py [--method helix|petals|swarm|sp] [--rate R] [--duration S] [--quick]
                                          [--json] [--cprofile N]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetnode.planner.cluster import load_cluster
from hetnode.planner.model import model_spec
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.profile_sources import profile_table_for
from hetnode.testnet.sim import helix_online_rate, load_trace, replay, simulate
from hetnode.testnet.sim.runner import measured_peak

TARGET_S = 60.0  # the whole 30-minute run, on one core
CLUSTER_FILE = Path(__file__).resolve().parents[1] / "hetnode" / "testnet" / "clusters" / "helix-hetero.toml"


def make_plan(cluster: Any, model: Any, profiles: Any, method: str, time_limit: float | None,
              path: str | None) -> tuple[PlacementPlan, float]:
    t0 = time.perf_counter()
    if path:
        plan = PlacementPlan.from_json(json.loads(Path(path).read_text()))
    else:
        from hetnode.planner.placement import PlannerOptions, plan_placement

        options = PlannerOptions(**({"time_limit_s": time_limit} if time_limit else {}))
        plan = plan_placement(cluster, model, profiles, method=method, options=options)
    return plan, time.perf_counter() - t0


def run_benchmark(*, method: str = "helix", rate: float | None = None, peak: str = "measured",
                  duration_s: float = 1800.0, warmup_s: float = 30.0, time_limit: float | None = None,
                  plan_path: str | None = None, cprofile: int = 0, seed: int = 0) -> dict[str, Any]:
    cluster = load_cluster(CLUSTER_FILE)
    model = model_spec("llama-70b")
    profiles = profile_table_for(cluster, model, "auto")
    plan, plan_s = make_plan(cluster, model, profiles, method, time_limit, plan_path)
    trace = load_trace("conv")
    peak_tokens_s = None
    if rate is None:
        if peak == "maxflow":
            peak_tokens_s = plan.max_flow
        else:  # an offline run of the same configuration, a third as long as the online one (at most 600 s)
            offline_s = min(600.0, duration_s / 3)
            peak_tokens_s = measured_peak(cluster, model, profiles, plan, trace=trace, seed=seed,
                                          duration_s=offline_s, warmup_s=offline_s / 10)
        rate = helix_online_rate(peak_tokens_s, trace.mean_input, trace.mean_output)
    workload = replay(trace, rate=rate, duration_s=duration_s)

    profiler = cProfile.Profile() if cprofile else None
    cpu0, wall0 = time.process_time(), time.perf_counter()
    if profiler is not None:
        profiler.enable()
    result = simulate(cluster, model, profiles, plan, workload=workload, duration_s=duration_s, warmup_s=warmup_s,
                      seed=seed)
    if profiler is not None:
        profiler.disable()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    s = result.summary
    tokens = sum(r.generated for r in result.requests)
    hops = sum(n.items for n in result.nodes)
    out: dict[str, Any] = {
        "cluster": cluster.name, "nodes": len(cluster.nodes), "model": model.name, "profiles": profiles.source,
        "method": plan.method, "plan_nodes": len(plan.placements), "plan_max_flow": plan.max_flow,
        "plan_s": plan_s, "trace": trace.source, "peak": None if peak_tokens_s is None else peak,
        "peak_tokens_s": peak_tokens_s, "rate": rate, "duration_s": duration_s,
        "requests": len(result.requests), "finished": sum(1 for r in result.requests if r.finished),
        "rejected": s["requests"]["rejected_all"], "generated_tokens": tokens, "item_hops": hops,
        "events": result.events, "sim_end_s": result.sim_end_s, "wall_s": wall, "cpu_s": cpu,
        "requests_per_wall_s": len(result.requests) / wall, "item_hops_per_cpu_s": hops / cpu,
        "events_per_cpu_s": result.events / cpu, "target_s": TARGET_S,
        "within_target": cpu <= TARGET_S * duration_s / 1800.0,
        "decode_throughput": s["decode_throughput"], "ttft_p50_s": s["latency"]["ttft"]["p50"],
        "tpot_p50_s": s["latency"]["tpot"]["p50"], "node_utilization_mean": s["node_utilization_mean"],
        "mean_depth": s["mean_depth"],
    }
    if profiler is not None:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(cprofile)
        out["cprofile"] = text.getvalue()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="helix", choices=["helix", "petals", "swarm", "sp"],
                        help="placement method of the planner (default: helix)")
    parser.add_argument("--plan", default=None, help="a plan JSON (hetnode plan --json) instead of planning")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds for the placement MILP")
    parser.add_argument("--rate", type=float, default=None,
                        help="requests/s (default: Helix's online rate, 75%% of the peak)")
    parser.add_argument("--peak", default="measured", choices=["measured", "maxflow"],
                        help="without --rate: the peak measured by an offline run (untimed), or the plan's max "
                             "flow (an upper bound; 75%% of it overloads the cluster)")
    parser.add_argument("--duration", type=float, default=1800.0, help="simulated seconds of arrivals")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 simulated minutes of a Petals plan: a smoke run")
    parser.add_argument("--cprofile", type=int, default=0, metavar="N", help="print the top N functions")
    parser.add_argument("--json", action="store_true", help="print the result dict as JSON only")
    args = parser.parse_args()
    if args.quick:
        args.duration = 120.0
        if args.plan is None:
            args.method = "petals"
    r = run_benchmark(method=args.method, rate=args.rate, peak=args.peak, duration_s=args.duration,
                      time_limit=args.time_limit, plan_path=args.plan, cprofile=args.cprofile, seed=args.seed)
    if args.json:
        print(json.dumps(r, indent=2))
        return
    print(f"{r['cluster']}: {r['nodes']} nodes, {r['model']}; {r['method']} plan over {r['plan_nodes']} nodes, "
          f"max flow {r['plan_max_flow']:.0f} tokens/s (planned in {r['plan_s']:.1f} s)")
    if r["peak"] is not None:
        how = "measured by an offline run" if r["peak"] == "measured" else "the plan's max flow"
        print(f"rate: 75% of a peak of {r['peak_tokens_s']:.0f} tokens/s ({how})")
    print(f"workload: {r['duration_s']:g} s of {r['trace']} at {r['rate']:.3g} req/s: {r['requests']} requests "
          f"({r['finished']} finished, {r['rejected']} refused by the scheduler), {r['generated_tokens']:,} tokens "
          f"generated, {r['item_hops']:,} item-hops through nodes, {r['events']:,} events, "
          f"simulated to {r['sim_end_s']:.0f} s")
    print(f"served: decode {r['decode_throughput']:.0f} tokens/s, TTFT p50 {r['ttft_p50_s']:.3g} s, "
          f"TPOT p50 {r['tpot_p50_s']:.3g} s, mean depth {r['mean_depth']:.2f}, "
          f"node utilization {r['node_utilization_mean']:.0%}")
    if r["duration_s"] == 1800:
        verdict = f"{'within' if r['within_target'] else 'OVER'} the {TARGET_S:g} s target"
    else:
        verdict = f"the {TARGET_S:g} s target is for 1800 simulated seconds, this run has {r['duration_s']:g}"
    print(f"speed: {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU ({verdict}); "
          f"{r['requests_per_wall_s']:,.0f} simulated requests per wall second, "
          f"{r['item_hops_per_cpu_s']:,.0f} item-hops and {r['events_per_cpu_s']:,.0f} events per CPU second")
    if "cprofile" in r:
        print(r["cprofile"])


if __name__ == "__main__":
    main()
