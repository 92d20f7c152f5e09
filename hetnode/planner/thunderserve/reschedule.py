"""Lightweight rescheduling (§3.4): new phases and a new orchestration for the groups a plan already runs.

When the workload shifts or GPUs leave, ThunderServe keeps every surviving group's GPUs and parallel
configuration (so no weights are reloaded) and re-runs Algorithm 1 with one move only, flipping a group's
phase, each deployment valued by the TSTP re-solved under the new workload with the layouts unchanged
(`LowerLevel.fixed`: a layout priced in whichever phase its group now has).

A group that lost a GPU is dropped whole: its remaining GPUs hold only part of the weights, and using them
would mean a reload, which is what this avoids; they stay idle until a full reschedule. The plan's layouts are
read back from the plan itself (each replica's nodes in layer order, `tp` at a time per stage, the layer
range of each stage from its placements), so a plan saved as JSON can be rescheduled by a process that never
ran the search. Pure and seeded like the search.
"""

from __future__ import annotations

import random
import time
from collections.abc import Collection
from dataclasses import dataclass, replace

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.thunderserve.deploy import plan_of, thunderserve_placement
from hetnode.planner.thunderserve.deployment import Deployment, Group
from hetnode.planner.thunderserve.gpus import GpuPool, gpu_pool
from hetnode.planner.thunderserve.lower import LowerLevel
from hetnode.planner.thunderserve.parallel import ROLES, Configured, Layout, Stage, performance
from hetnode.planner.thunderserve.settings import ThunderServeOptions
from hetnode.planner.thunderserve.tabu import tabu_search


@dataclass(frozen=True)
class Kept:
    """What survives of a plan: the cluster without the GPUs gone, and each whole group with its layout."""

    cluster: ClusterSpec
    pool: GpuPool
    groups: tuple[tuple[Group, Layout], ...]  # the plan's replica order (prefill ones first)
    dropped: tuple[int, ...]  # plan indices of the replicas that lost a GPU


def kept_groups(plan: PlacementPlan, cluster: ClusterSpec, gone: Collection[str] = ()) -> Kept:
    """The plan's groups whose GPUs are all still there, with their layouts (module docstring)."""
    if not plan.replicas:
        raise ConfigError(f"plan for {plan.cluster} has no replicas: only a phase-split plan can be rescheduled")
    names = {n.name for n in cluster.nodes}
    unknown = sorted(set(gone) - names)
    if unknown:
        raise ConfigError(f"cluster {cluster.name} has no node {', '.join(unknown)} (given as gone)")
    left = replace(cluster, nodes=tuple(n for n in cluster.nodes if n.name not in set(gone)))
    pool = gpu_pool(left)
    index = {g.name: i for i, g in enumerate(pool.gpus)}
    ranges = {p.node: (p.first_layer, p.last_layer) for p in plan.placements}
    groups: list[tuple[Group, Layout]] = []
    dropped: list[int] = []
    for k, r in enumerate(plan.replicas):
        missing = [n for n in r.nodes if n not in names]
        if missing:
            raise ConfigError(f"plan replica {k} runs on {', '.join(missing)}, which cluster {cluster.name} "
                              "does not have")
        if r.role not in ROLES or r.tp < 1 or len(r.nodes) % r.tp:
            raise ConfigError(f"plan replica {k}: role {r.role!r}, tp {r.tp} over {len(r.nodes)} nodes")
        if any(n not in index for n in r.nodes):
            dropped.append(k)
            continue
        stages = []
        for s in range(0, len(r.nodes), r.tp):
            cell = r.nodes[s:s + r.tp]
            if cell[0] not in ranges or any(ranges.get(n) != ranges[cell[0]] for n in cell):
                raise ConfigError(f"plan replica {k}: nodes {', '.join(cell)} of one stage do not hold one "
                                  "layer range")
            first, last = ranges[cell[0]]
            stages.append(Stage(tuple(index[n] for n in cell), first, last))
        layout = Layout(tp=r.tp, stages=tuple(stages))
        groups.append((Group(tuple(sorted(layout.gpus)), r.role), layout))
    return Kept(cluster=left, pool=pool, groups=tuple(groups), dropped=tuple(dropped))


def reschedule(plan: PlacementPlan, cluster: ClusterSpec, model: ModelSpec, options: ThunderServeOptions,
               gone: Collection[str] = (), steps: int | None = None) -> PlacementPlan:
    """§3.4: the plan's surviving groups, layouts kept, phases found by a flip-only tabu search of `steps`
    (default `options.steps`) under `options.traffic`, and the TSTP re-solved. The cluster is the one the plan
    was made for; `gone` names the GPUs that left. Raises ConfigError when no group survives."""
    began = time.perf_counter()
    kept = kept_groups(plan, cluster, gone)
    lower, start = _kept_lower(plan, kept, model, options, gone)
    best, log = tabu_search(start, kept.pool, model, lower, random.Random(options.seed),
                            steps=options.steps if steps is None else steps, neighbours=options.neighbours,
                            memory=options.memory, moves=("flip",))
    before = {g.gpus: g.role for g, _ in kept.groups}
    flips = sum(before[g.gpus] != g.role for g in best.deployment.groups)
    out = plan_of(kept.cluster, model, kept.pool, best, options, log, time.perf_counter() - began)
    note = (f"lightweight reschedule of {len(plan.replicas)} replicas: {len(kept.dropped)} dropped (a GPU gone), "
            f"{flips} phases flipped, layouts kept (no weights reloaded)")
    return replace(out, notes=(note, *out.notes))


@dataclass(frozen=True)
class Replanned:
    """A re-plan of a ThunderServe deployment: the new plan, and why it is not a lightweight reschedule ('' when it
    is one)."""

    plan: PlacementPlan
    why_full: str


def replan(current: PlacementPlan | None, cluster: ClusterSpec, left: ClusterSpec, model: ModelSpec,
           options: ThunderServeOptions, *, light: bool) -> Replanned:
    """What the coordinator plans for a ThunderServe deployment over the nodes of `left` (those up now), the plan
    in use being `current` on `cluster` (its nodes, gone ones included): §3.4's lightweight reschedule when `light`
    (a node lost or leaving, a shift of the mix), `current` is ThunderServe's and every up node is one it places
    (no node it could use has joined); a full search over `left` otherwise, or when the groups of `current` that
    survive cannot serve both phases. The coordinator's deployment and the simulator both re-plan with this."""
    if current is None or current.method != "thunderserve" or not light:
        return Replanned(thunderserve_placement(left, model, options), "a full re-plan was asked for")
    up = {n.name for n in left.nodes}
    placed = {p.node for p in current.placements}
    if not up <= placed:
        joined = ", ".join(sorted(up - placed))
        return Replanned(thunderserve_placement(left, model, options), f"{joined} joined: searching anew")
    # The plan's GPUs in its replicas' order, as the coordinator reads them back from its members: the search's
    # pool follows this order, so the same plan reschedules the same whatever order a cluster file lists them in.
    known = {n.name: n for n in cluster.nodes}
    own = replace(cluster, nodes=tuple(known[n] for r in current.replicas for n in r.nodes if n in known))
    try:
        light_plan = reschedule(current, own, model, options, gone=placed - up)
    except ConfigError as exc:
        return Replanned(thunderserve_placement(left, model, options), f"{exc}: searching anew")
    missing = sorted(set(ROLES) - {r.role for r in light_plan.replicas})
    if missing:  # one group left: no flip gives it both phases, and a scheduler needs both
        return Replanned(thunderserve_placement(left, model, options),
                         f"the surviving groups have no {' or '.join(missing)} replica: searching anew")
    return Replanned(light_plan, "")


def sustained_rate(plan: PlacementPlan, cluster: ClusterSpec, model: ModelSpec, options: ThunderServeOptions) -> float:
    """The requests/s the planner expects `plan` to sustain as it stands (its groups, layouts and phases): the
    weaker phase's rate, the search's tie-break (`LowerLevel`). It does not depend on the rate planned for, so a
    saturated deployment's window converges to it when the planner is right, and its orchestration solved at
    this rate is the one that deployment would be rescheduled to."""
    kept = kept_groups(plan, cluster)
    lower, start = _kept_lower(plan, kept, model, options, ())
    solved = lower.solve(start)
    if solved is None:
        raise ConfigError(f"plan for {plan.cluster}: a group has no layout")
    return solved.score[1]


def _kept_lower(plan: PlacementPlan, kept: Kept, model: ModelSpec, options: ThunderServeOptions,
                gone: Collection[str]) -> tuple[LowerLevel, Deployment]:
    """The lower level with the kept layouts fixed, and the kept groups as a deployment."""
    if not kept.groups:
        raise ConfigError(f"no group of the plan for {plan.cluster} survives without {', '.join(sorted(gone))}")
    fixed = {g.gpus: Configured(layout, performance(kept.pool, layout, model, options)) for g, layout in kept.groups}
    return LowerLevel(kept.pool, model, options, fixed=fixed), Deployment.of([g for g, _ in kept.groups])
