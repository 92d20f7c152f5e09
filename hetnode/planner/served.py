"""What a placement serves once KV memory and a request's lifetime count: the planner's final pick.

The max flow (Helix §4.3) prices every node by T_j, as if its KV fed it a full decode batch every step. In a
pipeline a request's KV sits on every stage of its route for its whole lifetime (output_len round trips of
one token through every stage), and a node's batch is only the requests whose token is at that node. So a
placement that sends all traffic through a few nodes in series, or through many thin stages, has a high max
flow and serves much less: measured in the simulator (scripts/reproduce_helix.py), Helix's single-cluster
LLaMA-30B plan has 1.11x SP's max flow and serves 0.72x of SP's decode throughput.

`served_estimate` prices a placement with its flows (the scheduler's weights) as paths from the
coordinator and back, and solves the steady state as a fixed point:

- at node n with decode batch b_n, one step for its batch takes d_n = j_n x (decode(b_n) + b_n / output_len x
  prefill(input_len)) (each decode step carries its share of the prompts that keep the batch full);
- a path's round trip is RT_p = sum of d_n over its stages + the links' latencies, and a request on it lives
  L_p = output_len x RT_p;
- N_p requests in flight on path p: maximize the request rate sum N_p / L_p subject to, at every node, the
  requests it holds fitting its KV (sum N_p <= kv_fill x kv_tokens / (input_len + output_len)), its token rate
  fitting its throughput at b_n, and every link's token rate fitting the link (an LP);
- b_n = sum over paths through n of N_p x d_n / RT_p (the share of a round trip the token spends at n),
  damped, and again.

It is an estimate for ranking placements, not a prediction of absolute throughput: on Helix's clusters it
ranks the simulator's offline decode throughput of every placement correctly in 4 of 5 cluster/model pairs
and reads about twice what the simulator serves (docs/planner.md).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping

import numpy as np
from scipy.optimize import linprog

from hetnode.planner.cluster import COORDINATOR, ClusterSpec
from hetnode.planner.flowgraph import link_capacity
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import SINK, SOURCE
from hetnode.planner.profile import ProfileTable, Workload, alone_batch, interpolate, kv_tokens, tokens_per_s_at

Range = tuple[int, int]
_ROUNDS = 8


def flow_paths(flows: Mapping[tuple[str, str], float]) -> list[tuple[list[str], float]]:
    """A decomposition of a source-sink flow into paths (node names, flow), widest edge first; deterministic."""
    left = {e: f for e, f in flows.items() if f > 0}
    total = sum(f for (a, _), f in left.items() if a == SOURCE)
    out: list[tuple[list[str], float]] = []
    while True:
        path, seen = [SOURCE], {SOURCE}
        while path[-1] != SINK:
            here = path[-1]
            steps = [(f, b) for (a, b), f in left.items() if a == here and b not in seen and f > 1e-9 * total]
            if not steps:
                break
            _, nxt = max(steps, key=lambda s: (s[0], s[1]))
            path.append(nxt)
            seen.add(nxt)
        if path[-1] != SINK:
            return out
        width = min(left[(a, b)] for a, b in itertools.pairwise(path))
        for a, b in itertools.pairwise(path):
            left[(a, b)] -= width
        out.append((path[1:-1], width))


def served_estimate(cluster: ClusterSpec, model: ModelSpec, profiles: ProfileTable, ranges: Mapping[str, Range],
                    flows: Mapping[tuple[str, str], float], workload: Workload | None = None) -> float:
    """Decode tokens per second the placement serves in steady state (module docstring); 0 without a path."""
    w = workload or Workload()
    paths = flow_paths(flows)
    if not paths:
        return 0.0
    nodes = sorted({n for p, _ in paths for n in p})
    prof = {n: profiles.for_node(n, cluster.node(n).device) for n in nodes}
    held = {n: ranges[n][1] - ranges[n][0] for n in nodes}
    seq = w.input_len + w.output_len
    holds = {n: w.kv_fill * kv_tokens(prof[n].memory_bytes, model, held[n]) / seq for n in nodes}
    # Step times in the units of the profile's T_j: where T came as numbers beside unrelated curves (or from
    # other measurements), the curves are scaled so that the node alone runs at exactly its T_j.
    scale = {}
    for n in nodes:
        given = prof[n].tokens_per_s(held[n])
        curves = tokens_per_s_at(prof[n], w, held[n], alone_batch(prof[n], model, w, held[n]))
        scale[n] = curves / given if given > 0 and curves > 0 else 1.0
    prompt = {n: scale[n] * interpolate(prof[n].prompt_curve, w.input_len) for n in nodes}
    latency = []
    hops: dict[tuple[str, str], list[int]] = {}
    for i, (p, _) in enumerate(paths):
        ends = [COORDINATOR, *p, COORDINATOR]
        latency.append(sum(cluster.link(a, b).latency_ms / 1e3 for a, b in itertools.pairwise(ends)))
        for a, b in zip([SOURCE, *p], [*p, SINK], strict=True):
            hops.setdefault((a, b), []).append(i)
    links = [(idx, cap) for (a, b), idx in hops.items()
             if math.isfinite(cap := link_capacity(cluster, model, a, b))]
    through = {n: [i for i, (p, _) in enumerate(paths) if n in p] for n in nodes}
    batch = {n: max(1.0, holds[n] * held[n] / model.num_layers) for n in nodes}
    served = 0.0
    for _ in range(_ROUNDS):
        step = {n: held[n] * (scale[n] * interpolate(prof[n].decode_curve, batch[n])
                              + batch[n] / max(1, w.output_len) * prompt[n]) for n in nodes}
        rate = {n: batch[n] * seq / max(1, w.output_len) / step[n] for n in nodes}  # tokens/s at that batch
        trip = [sum(step[n] for n in p) + latency[i] for i, (p, _) in enumerate(paths)]
        life = np.array([max(1, w.output_len) * t for t in trip])
        rows, bounds = [], []
        for n in nodes:
            kv = np.zeros(len(paths))
            kv[through[n]] = 1.0
            rows.append(kv)
            bounds.append(holds[n])
            work = np.zeros(len(paths))
            work[through[n]] = seq / life[through[n]]
            rows.append(work)
            bounds.append(rate[n])
        for idx, cap in links:
            row = np.zeros(len(paths))
            row[idx] = seq / life[idx]
            rows.append(row)
            bounds.append(cap)
        result = linprog(-1.0 / life, A_ub=np.array(rows), b_ub=np.array(bounds), bounds=(0, None), method="highs")
        if result.status != 0:
            return served
        inflight = result.x
        served = float(-result.fun) * w.output_len
        batch = {n: 0.5 * batch[n] + 0.5 * max(1.0, sum(inflight[i] * step[n] / trip[i] for i in through[n]))
                 for n in nodes}
    return served
