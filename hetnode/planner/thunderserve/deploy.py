"""`plan_placement(method="thunderserve")`: Algorithm 1 over the cluster's GPUs, and the plan it gives.

The plan is a phase-split plan like method "split"'s: one replica per group with its phase, its nodes in
layer order (a stage's `tp` GPUs one after the other, all holding the stage's layers), and the orchestration
(X, Y) the coordinator routes by. Its flows are empty and its max flow 0: a ThunderServe plan is not a
max-flow plan, and validate_plan checks its replicas and orchestration instead. Pure: the search counts steps
and evaluations; the clock only measures the solve time.
"""

from __future__ import annotations

import random
import time

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import NodePlacement, Orchestration, PlacementPlan, Replica
from hetnode.planner.thunderserve.deployment import initial
from hetnode.planner.thunderserve.gpus import GpuPool, gpu_pool
from hetnode.planner.thunderserve.lower import LowerLevel, Solution
from hetnode.planner.thunderserve.settings import ThunderServeOptions
from hetnode.planner.thunderserve.tabu import Progress, SearchLog, tabu_search


def thunderserve_placement(cluster: ClusterSpec, model: ModelSpec, options: ThunderServeOptions | None = None,
                           progress: Progress | None = None) -> PlacementPlan:
    began = time.perf_counter()
    options = options or ThunderServeOptions()
    pool = gpu_pool(cluster)
    rng = random.Random(options.seed)
    start = initial(pool, model, rng)
    if start is None:
        raise ConfigError(f"cluster {cluster.name} cannot hold {model.name} in two groups of GPUs: ThunderServe "
                          "needs a prefill and a decode replica")
    lower = LowerLevel(pool, model, options)
    try:
        best, log = tabu_search(start, pool, model, lower, rng, steps=options.steps, neighbours=options.neighbours,
                                memory=options.memory, moves=options.moves, progress=progress)
    except ValueError as exc:
        raise ConfigError(f"cluster {cluster.name}: {exc}") from None
    return plan_of(cluster, model, pool, best, options, log, time.perf_counter() - began)


def plan_of(cluster: ClusterSpec, model: ModelSpec, pool: GpuPool, best: Solution, options: ThunderServeOptions,
            log: SearchLog | None, seconds: float, method: str = "thunderserve") -> PlacementPlan:
    replicas: list[Replica] = []
    placements: list[NodePlacement] = []
    lines: list[str] = []
    for role, configured in (("prefill", best.prefill), ("decode", best.decode)):
        for k, (_, c) in enumerate(configured):
            nodes = tuple(pool.gpus[g].name for s in c.layout.stages for g in s.gpus)
            replicas.append(Replica(role=role, nodes=nodes, tp=c.layout.tp))
            placements += [NodePlacement(pool.gpus[g].name, s.first_layer, s.last_layer)
                           for s in c.layout.stages for g in s.gpus]
            perf = c.performance
            held = (f" for the decode alone, {best.decode_capacity[k]:.2f} held from admission"
                    if role == "decode" and k < len(best.decode_capacity) else "")
            lines.append(f"{role} {k}: (tp {c.layout.tp}, pp {len(c.layout.stages)}), layers "
                         f"{[s.layers for s in c.layout.stages]}, prefill {perf.prefill_s:.3f} s at "
                         f"{perf.prefill_rate:.2f}/s, decode batch {perf.max_batch} at {perf.decode_rate:.2f} req/s"
                         f"{held}")
    routing = best.routing
    traffic = options.traffic
    slo = LowerLevel(pool, model, options).slo
    notes = [f"estimated SLO attainment {routing.attainment:.1%} at {traffic.rate:g} requests/s of "
             f"{traffic.input_len:g} in, {traffic.output_len:g} out (SLOs: TTFT {slo.ttft_s:.2f} s, TPOT "
             f"{slo.tpot_s * 1000:.0f} ms, E2E {slo.e2e_s:.1f} s); the replicas take {routing.routed:.1%} of "
             f"requests; the weaker phase sustains {best.score[1]:.2f} requests/s", *lines]
    if log is not None:
        notes.append(f"tabu search: {log.steps} steps, {log.proposed} neighbours, {log.evaluations} evaluations, "
                     f"{log.improvements} improvements, best at step {log.best_step}")
    order = {n.name: i for i, n in enumerate(cluster.nodes)}
    return PlacementPlan(
        cluster=cluster.name, model=model.name, num_layers=model.num_layers, method=method,
        placements=tuple(sorted(placements, key=lambda p: order[p.node])), status="heuristic",
        solve_time_s=seconds, partial_inference=False, notes=tuple(notes), connections=(),
        replicas=tuple(replicas),
        orchestration=Orchestration(prefill_share=routing.prefill_share, decode_share=routing.decode_share,
                                    slo_attainment=routing.attainment))
