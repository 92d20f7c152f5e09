#!/usr/bin/env python
"""Routing decisions per second on one core: Helix's IWRR scheduler and the §6.7 baselines, on a 42-node plan.

One decision is one `submit` (a per-request pipeline: the walk, the KV mask, the round-robin) plus the
`finish` that frees it later. The benchmark keeps a number of requests in flight (each submit is followed by
the end of the oldest one), so the KV estimate is never empty: a light scenario (no node masked) and a
saturated one (requests queue; each finish starts the next). Prompt lengths are drawn (seeded) from a spread
like the Azure conversation trace's. The target is 20,000 decisions/s per policy.

Beside them, Cronus's routing (`CronusScheduler` on one A100+A10 pair serving LLaMA-3 8B, its balancer fitted on
the two devices): one decision is a `submit` whose split Algorithm 1 picks among its 512 candidates, then its
first token (`prefilled`) and, once `inflight` requests run, the `finish` of the oldest; its rate is set beside
IWRR's in the first scenario.

The plan is, in order of preference: a plan JSON given with `--plan` (`hetnode plan ... --json`), the
planner's Petals placement of hetnode/testnet/clusters/helix-hetero.toml when both exist, or a synthetic
42-node plan: Helix's kind of heterogeneous cluster (A100, V100, L4, 2xL4, T4, 2xT4, 4xT4 nodes in two
regions) serving LLaMA-2 70B, Petals-style ranges (each node where the layers are served slowest), and the
flows of networkx's max flow with the slower links between regions.

The partially disaggregated designs' per-request decisions are timed beside it ("partial" in the result):
EcoServe's macro-instance scheduler (Algorithms 1-2 over 8 and 16 instances' reported states, each holding 64
decodes and a few pending prompts; each decision is one `route` plus the routed instance's status report, as
instances report when they change) and Cronus's balancer (`CronusBalancer.split`, Algorithm 1's choice among 512
candidate split points, against a CPI with 64 decodes), beside the plain scan of all 512 that it must agree with
(`_scan_split`, "cronus-balancer-scan") on the same prompts in the same run.

    .venv/bin/python scripts/bench_scheduler.py [--decisions 50000] [--inflight N] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import networkx as nx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hetnode.coordinator.routing import make_scheduler, scheduler_names
from hetnode.coordinator.scheduler import PipelineScheduler, plan_edges
from hetnode.planner.cluster import load_cluster
from hetnode.planner.model import PRESETS
from hetnode.planner.plan import SINK, SOURCE, NodePlacement, PlacementPlan
from hetnode.planner.profile import kv_tokens
from hetnode.planner.profile_sources import profile_table_for
from hetnode.policy.cronus import ChunkedIteration, CpiState, CronusBalancer, LinearPrefill, Split, _scan_split
from hetnode.policy.ecoserve import Decoding, InstanceState, Slos
from hetnode.policy.macro_scheduler import MacroScheduler
from hetnode.policy.prefill_predictor import PROFILE_LENGTHS, PrefillPredictor

TARGET = 20_000  # decisions/s
CLUSTER_FILE = Path(__file__).resolve().parents[1] / "hetnode" / "testnet" / "clusters" / "helix-hetero.toml"

# (device, nodes, GiB, layers of LLaMA-2 70B held, layer-tokens/s): rough relative speeds, for flows only.
DEVICES = (
    ("a100", 4, 80, 30, 30_000.0),
    ("v100", 6, 32, 10, 9_000.0),
    ("l4", 8, 24, 8, 9_000.0),
    ("2xl4", 6, 48, 16, 16_000.0),
    ("t4", 10, 16, 5, 4_000.0),
    ("2xt4", 4, 32, 10, 7_500.0),
    ("4xt4", 4, 64, 20, 14_000.0),
)
INTRA_TOKENS_S = 10e9 / 8 / 16_384  # 10 Gb/s over one 8192-wide fp16 hidden state
INTER_TOKENS_S = 100e6 / 8 / 16_384  # 100 Mb/s between the two regions


def synthetic_plan() -> tuple[PlacementPlan, dict[str, int], dict[str, float]]:
    """A 42-node plan, each node's KV capacity (tokens) and its throughput T (tokens/s)."""
    model = PRESETS["llama-70b"]
    nodes: list[tuple[str, int, float, int]] = []  # name, layers, T, kv tokens
    for device, count, gib, layers, speed in DEVICES:
        for i in range(count):
            nodes.append((f"{device}-{i}", layers, speed / layers, kv_tokens(gib << 30, model, layers)))
    assert len(nodes) == 42
    region = {name: i % 2 for i, (name, *_rest) in enumerate(nodes)}
    # Petals: fastest first, each node where the slowest window of its size is.
    coverage = [0.0] * model.num_layers
    ranges: dict[str, tuple[int, int]] = {}
    for name, k, t, _ in sorted(nodes, key=lambda n: -n[1] * n[2]):
        start = min(range(model.num_layers - k + 1), key=lambda s: (sum(coverage[s:s + k]), s))
        ranges[name] = (start, start + k)
        for layer in range(start, start + k):
            coverage[layer] += t
    plan = PlacementPlan("synthetic-42", model.name, model.num_layers, "petals",
                         tuple(NodePlacement(n, a, b) for n, (a, b) in sorted(ranges.items())))
    throughput = {name: t for name, _, t, _ in nodes}
    g = nx.DiGraph()
    for name in ranges:
        g.add_edge(f"{name}:in", f"{name}:out", capacity=throughput[name])
    for a, b in plan_edges(plan, "topology"):
        u = SOURCE if a == SOURCE else f"{a}:out"
        v = SINK if b == SINK else f"{b}:in"
        ra = 0 if a in (SOURCE, SINK) else region[a]
        rb = 0 if b in (SOURCE, SINK) else region[b]
        g.add_edge(u, v, capacity=INTRA_TOKENS_S if ra == rb else INTER_TOKENS_S)
    # Edmonds-Karp walks the graph in insertion order: the same flows in every process (preflow-push's
    # result depends on string hashing, which changes from run to run).
    value, flow = nx.maximum_flow(g, SOURCE, SINK, flow_func=nx.algorithms.flow.edmonds_karp)
    flows = {}
    for u, targets in flow.items():
        for v, f in targets.items():
            if f > 0 and not (u.endswith(":in") and v.endswith(":out")):
                flows[(u.removesuffix(":out"), v.removesuffix(":in"))] = float(f)
    plan = PlacementPlan(plan.cluster, plan.model, plan.num_layers, "petals", plan.placements, flows=flows,
                         max_flow=float(value), status="synthetic")
    return plan, {name: kv for name, _, _, kv in nodes}, throughput


def planner_plan() -> tuple[PlacementPlan, dict[str, int], dict[str, float]] | None:
    """The planner's Petals plan of helix-hetero.toml (as `hetnode plan --method petals` makes it), with each
    node's KV capacity and T_j from the same profiles; None when the planner or the file is not there."""
    if not CLUSTER_FILE.exists():
        return None
    try:
        from hetnode.planner.placement import plan_placement
    except ImportError:
        return None
    model = PRESETS["llama-70b"]
    try:  # the planner is not this benchmark's subject: whatever goes wrong there, fall back
        cluster = load_cluster(CLUSTER_FILE)
        profiles = profile_table_for(cluster, model)
        plan = plan_placement(cluster, model, profiles, method="petals")
        kv, throughput = {}, {}
        for p in plan.placements:
            prof = profiles.for_node(p.node, cluster.node(p.node).device)
            kv[p.node] = kv_tokens(prof.memory_bytes, model, p.layers)
            throughput[p.node] = prof.tokens_per_s(p.layers)
    except Exception as exc:
        print(f"(no planner plan: {type(exc).__name__}: {exc}; using the synthetic plan)", file=sys.stderr)
        return None
    return plan, kv, throughput


def load_plan(path: str | None) -> tuple[PlacementPlan, dict[str, int], dict[str, float], str]:
    if path:
        plan = PlacementPlan.from_json(json.loads(Path(path).read_text()))
        model = PRESETS.get(plan.model, PRESETS["llama-70b"])
        kv = {p.node: kv_tokens(24 << 30, model, p.layers) for p in plan.placements}  # memory unknown: 24 GiB
        return plan, kv, {p.node: 1.0 for p in plan.placements}, path
    planned = planner_plan()
    if planned is not None:
        return (*planned, f"planner's petals plan of {CLUSTER_FILE.name}")
    return (*synthetic_plan(), "synthetic 42-node plan")


def describe(plan: PlacementPlan) -> dict[str, Any]:
    flows = plan_edges(plan, "flows")
    topology = plan_edges(plan, "topology")
    out_deg: dict[str, int] = {}
    for a, _ in topology:
        out_deg[a] = out_deg.get(a, 0) + 1
    return {"nodes": len(plan.placements), "layers": plan.num_layers, "flow_edges": len(flows),
            "topology_edges": len(topology), "max_out_degree": max(out_deg.values()),
            "max_flow_tokens_s": round(plan.max_flow, 1)}


def make(name: str, plan: PlacementPlan, kv: dict[str, int], throughput: dict[str, float],
         seed: int) -> PipelineScheduler:
    extra: dict[str, Any] = {}
    if name == "swarm":
        extra["throughput"] = throughput.__getitem__
    return make_scheduler(name, plan, kv_capacity=kv, seed=seed, **extra)


def workload(seed: int) -> tuple[list[int], list[int]]:
    """Prompt lengths log-normal around ~1000 tokens (the Azure conversation trace's spread), outputs ~240."""
    rng = random.Random(seed)
    prompts = [max(1, min(8000, int(rng.lognormvariate(6.6, 0.9)))) for _ in range(4096)]
    outputs = [max(1, int(rng.expovariate(1 / 240))) for _ in range(4096)]
    return prompts, outputs


def kv_room(plan: PlacementPlan, kv: dict[str, int], seed: int) -> int:
    """How many requests of the workload IWRR starts before the first one has to wait."""
    sched = make_scheduler("iwrr", plan, kv_capacity=kv)
    prompts, _ = workload(seed)
    for i in range(1_000_000):
        if not sched.submit(str(i), prompts[i & 4095], 0.0).assigned:
            return i
    return 1_000_000


def run_policy(name: str, plan: PlacementPlan, kv: dict[str, int], throughput: dict[str, float], *,
               decisions: int, inflight: int, seed: int) -> dict[str, float]:
    """Time `decisions` submits, each followed (once `inflight` requests are running or queued) by the end of
    the oldest one: `finish` if it runs, `cancel` if it still waits."""
    prompts, outputs = workload(seed)
    sched = make(name, plan, kv, throughput, seed)
    active: deque[str] = deque()
    stages = assigned = queued = rejected = 0
    now = 0.0

    def count(d: Any) -> None:
        nonlocal stages, assigned, queued, rejected
        if d.pipeline is not None:
            assigned += 1
            stages += len(d.pipeline)
        elif d.queued:
            queued += 1
        else:
            rejected += 1

    start = time.process_time()  # CPU time: the machine may be shared, and one core is what is measured
    for i in range(decisions):
        now += 0.001
        rid = str(i)
        d = sched.submit(rid, prompts[i & 4095], now)
        count(d)
        if not d.rejected:
            active.append(rid)
        if len(active) >= inflight:
            oldest = active.popleft()
            if sched.pipeline_of(oldest) is not None:
                released = sched.finish(oldest, outputs[i & 4095], now)
            else:
                released = sched.cancel(oldest, now)
            for d in released:
                count(d)
    elapsed = time.process_time() - start
    return {"decisions_s": decisions / elapsed, "us_per_decision": elapsed / decisions * 1e6,
            "ratio_to_target": decisions / elapsed / TARGET, "mean_stages": stages / max(assigned, 1),
            "assigned": assigned, "queued": queued, "rejected": rejected}


def run_benchmark(decisions: int = 50_000, inflight: int | None = None, repeats: int = 3, seed: int = 0,
                  policies: tuple[str, ...] | None = None, plan_path: str | None = None) -> dict[str, Any]:
    """Decisions/s of every policy (best of `repeats`) in each scenario, with the plan's shape.

    Scenarios, unless `inflight` fixes one: "light", half as many requests in flight as the KV estimate
    admits (no node masked), and "saturated", 256 more than it admits (nodes masked, requests queue, every
    finish starts the next waiting one: walks often meet dead ends and take the backward pass over the whole graph).
    """
    plan, kv, throughput, source = load_plan(plan_path)
    room = kv_room(plan, kv, seed)
    scenarios = {"fixed": inflight} if inflight else {"light": max(1, room // 2), "saturated": room + 256}
    result: dict[str, Any] = {"plan": source, **describe(plan), "kv_room_requests": room, "decisions": decisions,
                              "repeats": repeats, "target_decisions_s": TARGET, "scenarios": {}}
    for scenario, n in scenarios.items():
        cell: dict[str, Any] = {"inflight": n, "policies": {}}
        for name in policies or tuple(scheduler_names()):
            runs = [run_policy(name, plan, kv, throughput, decisions=decisions, inflight=n, seed=seed)
                    for _ in range(repeats)]
            cell["policies"][name] = max(runs, key=lambda r: r["decisions_s"])
        result["scenarios"][scenario] = cell
    result["partial"] = run_partial(decisions, repeats, seed)
    return result


def run_cronus(decisions: int, inflight: int, seed: int) -> dict[str, float]:
    """Cronus's routing decisions per second (CPU time of one thread)."""
    from hetnode.coordinator.cronus_scheduler import CronusScheduler
    from hetnode.planner.cronus_fit import fit_chunked_iteration, fit_partial_prefill
    from hetnode.planner.cronus_plan import cronus_placement
    from hetnode.planner.devices import parse_device

    model = PRESETS["llama3-8b"]
    high, low = parse_device("a100-80g"), parse_device("a10")
    plan = cronus_placement("bench", model, {"a100": high.fp16_tflops, "a10": low.fp16_tflops},
                            {"a100": high.memory_bytes, "a10": low.memory_bytes})
    balancer = CronusBalancer(fit_partial_prefill(low, model), fit_chunked_iteration(high, model, 512))
    sched = CronusScheduler(plan, splitters=[balancer], queue_limit=1 << 30)
    prompts, outputs = workload(seed)
    active: deque[str] = deque()
    splits = 0
    now = 0.0
    start = time.process_time()
    for i in range(decisions):
        now += 0.001
        rid = str(i)
        d = sched.submit(rid, prompts[i & 4095], now)
        splits += d.split is not None
        sched.prefilled(rid, now)  # the runtime's report: its first token (the PPI is done with it)
        active.append(rid)
        if len(active) >= inflight:
            sched.finish(active.popleft(), outputs[i & 4095], now)
    elapsed = time.process_time() - start
    return {"decisions_s": decisions / elapsed, "us_per_decision": elapsed / decisions * 1e6,
            "split_share": splits / decisions}


def run_partial(decisions: int, repeats: int, seed: int) -> dict[str, dict[str, float]]:
    """Decisions/s (best of `repeats`, CPU time of one thread) of EcoServe's and Cronus's per-request choices."""
    prompts, _ = workload(seed)
    out: dict[str, dict[str, float]] = {}
    for n in (8, 16):
        out[f"ecoserve-macro-{n}"] = max((_macro_run(n, prompts, decisions, seed) for _ in range(repeats)),
                                         key=lambda r: r["decisions_s"])
    balancer = CronusBalancer(LinearPrefill(2.5e-4, 0.02), ChunkedIteration(2e-6, 5e-7, 0.03))
    for name, split in (("cronus-balancer", balancer.split),
                        ("cronus-balancer-scan", lambda prompt, state: _scan_split(balancer, prompt, state))):
        out[name] = max((_cronus_run(split, prompts, decisions) for _ in range(repeats)),
                        key=lambda r: r["decisions_s"])
    return out


def _macro_run(instances: int, prompts: list[int], decisions: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    # An L20 TP=4 instance's prefill times (about 2,750 tokens/s: planner/instance_cost.py), as profiled.
    predictor = PrefillPredictor.fit([(n, 0.04 + n / 2750) for n in PROFILE_LENGTHS])
    sched = MacroScheduler(Slos(5.0, 0.1), predictor)

    def state(now: float, routed: int) -> InstanceState:
        decodes = tuple(Decoding(rng.randrange(1, 400), now - rng.uniform(0, 30)) for _ in range(64))
        return InstanceState(decodes, 400_000, routed)

    for k in range(instances):
        sched.add(k, state(0.0, 0))
    routed = dict.fromkeys(range(instances), 0)
    reports = [state(0.0, 0) for _ in range(64)]  # prebuilt, so that only the scheduler is timed
    start = time.process_time()
    now = 0.0
    for i in range(decisions):
        now += 0.001
        k = sched.route(prompts[i & 4095], prompts[i & 4095], now)
        routed[k] += 1  # type: ignore[index]
        r = reports[i & 63]
        sched.update(k, InstanceState(r.decodes, r.free_kv_tokens, routed[k]))
    elapsed = time.process_time() - start
    return {"decisions_s": decisions / elapsed, "us_per_decision": elapsed / decisions * 1e6}


def _cronus_run(split: Callable[[int, CpiState], Split], prompts: list[int], decisions: int) -> dict[str, float]:
    state = CpiState(decodes=64, decode_context=64 * 600, free_blocks=20_000, block_size=16, max_batch_tokens=512)
    start = time.process_time()
    for i in range(decisions):
        split(prompts[i & 4095], state)
    elapsed = time.process_time() - start
    return {"decisions_s": decisions / elapsed, "us_per_decision": elapsed / decisions * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decisions", type=int, default=50_000, help="submit + finish pairs per run")
    parser.add_argument("--inflight", type=int, default=None,
                        help="requests running or queued (default: a light and a saturated scenario)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per policy; the best is kept")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", nargs="+", choices=scheduler_names(), default=None)
    parser.add_argument("--plan", default=None, help="a plan JSON (PlacementPlan.to_json) instead of the default")
    parser.add_argument("--quick", action="store_true", help="a few thousand decisions, once: a smoke run")
    parser.add_argument("--json", action="store_true", help="print the result dict as JSON only")
    args = parser.parse_args()
    if args.quick:
        args.decisions, args.repeats = 3000, 1
    result = run_benchmark(args.decisions, args.inflight, args.repeats, args.seed,
                           tuple(args.policy) if args.policy else None, args.plan)
    first = next(iter(result["scenarios"].values()))
    cronus = max((run_cronus(args.decisions, first["inflight"], args.seed) for _ in range(args.repeats)),
                 key=lambda r: r["decisions_s"])
    iwrr = first["policies"].get("iwrr")
    result["cronus"] = {**cronus, "inflight": first["inflight"],
                        "vs_iwrr": cronus["decisions_s"] / iwrr["decisions_s"] if iwrr else None}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"{result['plan']}: {result['nodes']} nodes, {result['layers']} layers, {result['flow_edges']} edges "
          f"with flow, {result['topology_edges']} valid connections (max out-degree {result['max_out_degree']}), "
          f"max flow {result['max_flow_tokens_s']} tokens/s; KV room for {result['kv_room_requests']} requests")
    print(f"{result['decisions']} decisions (submit + finish) per run, best of {result['repeats']}, "
          f"CPU time of one thread; target {TARGET:,}/s")
    for scenario, cell in result["scenarios"].items():
        print(f"\n{scenario}: {cell['inflight']} requests in flight")
        print(f"{'policy':>14}  {'decisions/s':>11}  {'us/decision':>11}  {'vs target':>9}  {'stages':>6}  "
              f"{'queued':>6}  {'rejected':>8}")
        for name, r in cell["policies"].items():
            print(f"{name:>14}  {r['decisions_s']:>11,.0f}  {r['us_per_decision']:>11.1f}  "
                  f"{r['ratio_to_target']:>8.2f}x  {r['mean_stages']:>6.2f}  {r['queued']:>6}  {r['rejected']:>8}")
    c = result["cronus"]
    vs = f", {c['vs_iwrr']:.2f}x IWRR's ({next(iter(result['scenarios']))})" if c["vs_iwrr"] else ""
    print(f"\ncronus (A100+A10 pair, Algorithm 1 among 512 candidates): {c['decisions_s']:,.0f} decisions/s, "
          f"{c['us_per_decision']:.1f} us each{vs}; {c['split_share']:.0%} of prompts split")
    iwrr = max(c["policies"]["iwrr"]["decisions_s"] for c in result["scenarios"].values()
               if "iwrr" in c["policies"]) if any("iwrr" in c["policies"] for c in result["scenarios"].values()) else 0
    print("\npartially disaggregated designs' per-request decisions (beside IWRR's best scenario)")
    for name, r in result["partial"].items():
        beside = f"{r['decisions_s'] / iwrr:.2f}x IWRR" if iwrr else ""
        print(f"{name:>20}  {r['decisions_s']:>11,.0f}/s  {r['us_per_decision']:>8.1f} us  {beside}")


if __name__ == "__main__":
    main()
