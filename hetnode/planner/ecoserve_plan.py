"""EcoServe's placement (§3.3, §3.5): every node an instance holding the whole model, grouped into macro-instances.

EcoServe's instance is one model replica that runs both phases (partially disaggregated: it alternates them in
time); a macro-instance is a group of instances whose macro-instance scheduler staggers them (rolling
activation). Nodes that hold all the model's layers become instances, in the order of their names (a plan is a
deterministic function of the members). The macro-instances are what mitosis (`policy.ecoserve.Mitosis`) grows
one instance at a time between N_l and N_u, through the overall scheduler the simulator scales with, so a
cluster of up to N_u instances is one macro-instance, and the (N_u + 1)-th splits N_l instances off into a
second one.

Nodes that cannot hold the whole model form instances too, as pipelines (EcoServe's instances are
tensor-parallel groups; the runtime has pipelines, not tensor parallelism): taken by memory, largest first, each
holding what half its memory takes of layers (Helix's rule for a node that shares its memory with KV), until a
pipeline holds every layer; the layers are cut in proportion to what each node holds. A pipeline is one
instance, named by its first node. Nodes too few to complete one more pipeline hold nothing.

The plan's replicas list each instance as one replica whose role names its macro-instance ("macro0",
"macro1", ...), which `coordinator/ecoserve_scheduler.py` routes.
"""

from __future__ import annotations

from collections.abc import Mapping

from hetnode.errors import ConfigError
from hetnode.planner.costmodel import step_time
from hetnode.planner.cronus_plan import MeasuredDevice, measured_device
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
from hetnode.planner.profile import max_layers_for
from hetnode.policy.ecoserve import InstanceState, Slos
from hetnode.policy.ecoserve_overall import Overall
from hetnode.policy.macro_scheduler import MacroScheduler
from hetnode.policy.prefill_predictor import PROFILE_LENGTHS, PrefillPredictor

MACRO = "macro"  # a replica's role: MACRO + the index of its macro-instance
N_LOWER, N_UPPER = 4, 16  # the simulator's defaults (PadgOptions: Fig. 10's N_l)


def macro_groups(instances: list[str], lower: int = N_LOWER, upper: int = N_UPPER) -> list[list[str]]:
    """The macro-instances after the overall scheduler has added `instances` one at a time (splits included):
    the grouping the coordinator's scheduler builds the same way."""
    overall = Overall(lower, upper, lambda: MacroScheduler(Slos(1.0, 1.0), lambda n: 0.0))
    for n in instances:
        overall.add(n, InstanceState())
    return [[str(i) for i in m.ids] for m in overall.macros]


def macro_of(role: str) -> int:
    """The macro-instance index a replica's role names; ConfigError for a role that is not one."""
    if not role.startswith(MACRO) or not role[len(MACRO):].isdigit():
        raise ConfigError(f"an EcoServe replica's role is {MACRO}<index>, not {role!r}")
    return int(role[len(MACRO):])


STAGE_KV_SHARE = 0.5  # of a pipelined instance's node's memory kept for KV


def pipelines(model: ModelSpec, memory_bytes: Mapping[str, int]) -> list[list[tuple[str, int, int]]]:
    """Pipelined instances of nodes that cannot hold the whole model (module docstring): each a list of
    (node, first layer, last layer)."""
    holds = {n: max_layers_for(m, model, STAGE_KV_SHARE) for n, m in memory_bytes.items()}
    order = sorted((n for n in holds if holds[n] > 0), key=lambda n: (-memory_bytes[n], n))
    out: list[list[tuple[str, int, int]]] = []
    group: list[str] = []
    for n in order:
        group.append(n)
        total = sum(holds[g] for g in group)
        if total < model.num_layers:
            continue
        stages, first, given = [], 0, 0
        for i, g in enumerate(group):  # in proportion to what each holds, every layer once
            given += holds[g]
            last = model.num_layers if i == len(group) - 1 else round(model.num_layers * given / total)
            stages.append((g, first, last))
            first = last
        out.append(stages)
        group = []
    return out


def ecoserve_placement(cluster: str, model: ModelSpec, memory_bytes: Mapping[str, int], *,
                       lower: int = N_LOWER, upper: int = N_UPPER) -> PlacementPlan:
    """Instances on the nodes of `memory_bytes`: each node that holds the whole model, and pipelines of those
    that do not; in macro-instances."""
    weights = model.num_layers * model.layer_bytes
    fit = sorted(n for n in memory_bytes if memory_bytes[n] > weights)
    piped = pipelines(model, {n: m for n, m in memory_bytes.items() if n not in fit})
    stages = {p[0][0]: p for p in piped}
    stages.update({n: [(n, 0, model.num_layers)] for n in fit})
    if not stages:
        raise ConfigError(f"EcoServe needs nodes that hold all of {model.name} ({weights / 2**30:.1f} GiB of "
                          f"layers), alone or as a pipeline; none of the {len(memory_bytes)} do")
    replicas = [Replica(f"{MACRO}{k}", tuple(s[0] for s in stages[n]))
                for k, group in enumerate(macro_groups(sorted(stages), lower, upper)) for n in group]
    placed = {s[0] for p in stages.values() for s in p}
    left = sorted(set(memory_bytes) - placed)
    notes = (f"cannot hold the model, nor complete a pipeline: {', '.join(left)}",) if left else ()
    return PlacementPlan(cluster=cluster, model=model.name, num_layers=model.num_layers, method="ecoserve",
                         placements=tuple(NodePlacement(n, a, b) for p in stages.values() for n, a, b in p),
                         status="heuristic", partial_inference=False, notes=notes, replicas=tuple(replicas))


def fit_prefill(stages: list[tuple[MeasuredDevice, int]], model: ModelSpec) -> PrefillPredictor:
    """Algorithm 2's prefill-time predictor for an instance (its nodes' profiles and the layers each holds),
    fitted on the cost model of the numbers the nodes advertised at join time (their measured ones, or their
    emulated GPU's), at the simulator's profiled lengths: a pipeline's prefill passes its stages one by one."""
    shape = model.shape
    return PrefillPredictor.fit([(n, sum(step_time(measured_device(p), shape, layers, n, n,
                                                   attended_pairs=n * (n + 1) // 2) for p, layers in stages))
                                 for n in PROFILE_LENGTHS])


def ecoserve_predictors(plan: PlacementPlan, model: ModelSpec,
                        profiles: Mapping[str, MeasuredDevice]) -> dict[str, PrefillPredictor]:
    """Each instance's predictor, by its first node; ConfigError for an instance with a node without a profile."""
    ranges = plan.ranges()
    out = {}
    for r in plan.replicas:
        missing = [n for n in r.nodes if n not in profiles]
        if missing:
            raise ConfigError(f"no profile for {', '.join(missing)} of the EcoServe instance {r.nodes[0]}")
        out[r.nodes[0]] = fit_prefill([(profiles[n], ranges[n][1] - ranges[n][0]) for n in r.nodes], model)
    return out
