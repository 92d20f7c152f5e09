"""EcoServe's placement (§3.3, §3.5): every node an instance holding the whole model, grouped into macro-instances.

EcoServe's instance is one model replica that runs both phases (partially disaggregated: it alternates them in
time); a macro-instance is a group of instances whose macro-instance scheduler staggers them (rolling
activation). Nodes that hold all the model's layers become instances, in the order of their names (a plan is a
deterministic function of the members). The macro-instances are what mitosis (`policy.ecoserve.Mitosis`) grows
one instance at a time between N_l and N_u, through the overall scheduler the simulator scales with, so a
cluster of up to N_u instances is one macro-instance, and the (N_u + 1)-th splits N_l instances off into a
second one.

The plan's replicas list each instance as one replica whose role names its macro-instance ("macro0",
"macro1", ...), which `coordinator/ecoserve_scheduler.py` routes. A node that cannot hold the whole model holds
nothing (EcoServe's instances are whole replicas; a replica pipelined over several small nodes is not built
here).
"""

from __future__ import annotations

from collections.abc import Mapping

from hetnode.errors import ConfigError
from hetnode.planner.costmodel import step_time
from hetnode.planner.cronus_plan import MeasuredDevice, measured_device
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import NodePlacement, PlacementPlan, Replica
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
        overall.add(n, InstanceState(switched_at=0.0))
    return [[str(i) for i in m.ids] for m in overall.macros]


def macro_of(role: str) -> int:
    """The macro-instance index a replica's role names; ConfigError for a role that is not one."""
    if not role.startswith(MACRO) or not role[len(MACRO):].isdigit():
        raise ConfigError(f"an EcoServe replica's role is {MACRO}<index>, not {role!r}")
    return int(role[len(MACRO):])


def ecoserve_placement(cluster: str, model: ModelSpec, memory_bytes: Mapping[str, int], *,
                       lower: int = N_LOWER, upper: int = N_UPPER) -> PlacementPlan:
    """Instances on the nodes of `memory_bytes` whose memory holds the whole model, in macro-instances."""
    weights = model.num_layers * model.layer_bytes
    fit = sorted(n for n in memory_bytes if memory_bytes[n] > weights)
    if not fit:
        raise ConfigError(f"EcoServe needs a node that holds all of {model.name} ({weights / 2**30:.1f} GiB of "
                          f"layers); none of {len(memory_bytes)} does")
    replicas = [Replica(f"{MACRO}{k}", (n,)) for k, group in enumerate(macro_groups(fit, lower, upper))
                for n in group]
    left = sorted(set(memory_bytes) - set(fit))
    notes = (f"cannot hold the model: {', '.join(left)}",) if left else ()
    return PlacementPlan(cluster=cluster, model=model.name, num_layers=model.num_layers, method="ecoserve",
                         placements=tuple(NodePlacement(n, 0, model.num_layers) for n in fit),
                         status="heuristic", partial_inference=False, notes=notes, replicas=tuple(replicas))


def fit_prefill(profile: MeasuredDevice, model: ModelSpec) -> PrefillPredictor:
    """Algorithm 2's prefill-time predictor for a node, fitted on the cost model of the numbers it advertised at
    join time (its measured ones, or its emulated GPU's), at the simulator's profiled lengths."""
    device, shape = measured_device(profile), model.shape
    return PrefillPredictor.fit([(n, step_time(device, shape, model.num_layers, n, n, attended_pairs=n * (n + 1) // 2))
                                 for n in PROFILE_LENGTHS])


def ecoserve_predictors(plan: PlacementPlan, model: ModelSpec,
                        profiles: Mapping[str, MeasuredDevice]) -> dict[str, PrefillPredictor]:
    """Each instance's predictor; ConfigError for an instance whose node has no profile."""
    out = {}
    for r in plan.replicas:
        profile = profiles.get(r.nodes[0])
        if profile is None:
            raise ConfigError(f"no profile for the EcoServe instance {r.nodes[0]}")
        out[r.nodes[0]] = fit_prefill(profile, model)
    return out
