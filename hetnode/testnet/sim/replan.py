"""Nodes lost and plans replaced in the middle of a run (ThunderServe §3.4, §5.4's Fig. 11), as the runtime's
coordinator handles them.

- `Loss(at, nodes)`: cluster nodes (GPUs; a tensor-parallel stage goes down with any of its GPUs) go down at
  `at`. What they were doing is lost: their queues, their step under way, the KV they hold, whatever reaches
  them later. The coordinator learns it at once, as it does when a killed node's control stream closes, and
  does what the runtime's does (`SimCoordinator.node_down`): the serving plan's scheduler masks them, and every
  request whose route they fail (`Lifecycle.fails_when_down`) moves for cause "lost": it re-prefills its context
  on a route of the serving plan, or ends after its last move.
- `Replan(at, plan)`: at `at` the coordinator has a new plan and assigns it. A node whose shard stays (the same
  GPUs holding the same layers: the node's own rule, `policy.shards.reloads`) keeps serving, its sessions
  included; only its role's step setting follows (a phase flip, `role_batching.py`). A node the new plan
  changes or leaves out drops its shard at once: the serving plan masks it and the requests it fails move, as
  for a loss; one with a changed shard serves again `reload_s` later. The new plan serves once each of its
  nodes has answered its assignment (a round trip to the coordinator; after the reload for a changed shard):
  its scheduler then takes every new request and move, the requests the old one had queued retry on it, and
  requests already running finish on their old routes, accounted in the scheduler that admitted them
  (`SimCoordinator.switch`, as the deployment switches in `Deployment.on_status` and `_retire`).

`after_loss` makes the re-plan the coordinator makes after a loss: for a ThunderServe plan the planner's
`replan` (§3.4's lightweight reschedule of the plan in use, a full search when asked for or when nothing
survives), for any other plan a full re-plan by the method's planner. It runs before the simulation (the
planner is pure: the same inputs give the same plan whenever it runs) on the traffic the caller plans for, where
the coordinator plans for the mix its window has seen; `at` is the loss, plus the coordinator's debounce of a
membership change, plus the planner's CPU time measured on this machine (or a delay given).

Where the simulator differs from the runtime, and why:

- A node whose shard changes drops it before it loads the new one; the runtime loads the new one beside it when
  both fit (for ThunderServe's deployments they do not: their weights fill the GPUs but `kv_reserve`).
- The requests that a dropped shard fails re-prefill their context on their next route; the runtime moves those
  whose last phase runs there with their KV (`_Leaving`, Freeze and Export), and lets an idle node finish the
  prefills it runs. The simulator moves no KV between routes (docs/simulator.md).
- A reload takes `reload_s` for every node, a stated figure (ThunderServe's Table 4: 103 s to reload LLaMA-30B's
  weights in a full rescheduling), not one measured here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from hetnode.errors import ConfigError
from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.model import ModelSpec
from hetnode.planner.plan import PlacementPlan
from hetnode.planner.profile import ProfileTable
from hetnode.policy.role_batching import prompt_tokens_for
from hetnode.policy.shards import reloads

if TYPE_CHECKING:
    from hetnode.planner.thunderserve.settings import ThunderServeOptions
    from hetnode.testnet.sim.coordinator import Scheduler, SimCoordinator
    from hetnode.testnet.sim.core import Simulation
    from hetnode.testnet.sim.node import SimNode

RESCHEDULES = ("lightweight", "full", "none")
# ThunderServe's Table 4: reloading LLaMA-30B's weights takes 103 (+-10) s in a full rescheduling.
RELOAD_S = 103.0
# The coordinator plans once for a burst of membership changes, this long after the first (`Deployment`).
DEBOUNCE_S = 0.5


@dataclass(frozen=True)
class Loss:
    """Cluster nodes that go down at `at` seconds."""

    at: float
    nodes: tuple[str, ...]


@dataclass(frozen=True)
class Replan:
    """A new plan the coordinator has at `at` seconds (for the run's cluster, its tensor-parallel stages as the
    planner made them); `profiles` must cover the nodes it adds (None: the run's table)."""

    at: float
    plan: PlacementPlan
    reload_s: float = RELOAD_S
    profiles: ProfileTable | None = field(default=None, hash=False)
    how: str = ""  # lightweight or full, for the report
    planner_s: float = 0.0  # the planner's CPU seconds, part of `at`
    note: str = ""  # why it is not the rescheduling asked for, when it is not

    def __post_init__(self) -> None:
        if not self.at >= 0 or not 0 <= self.reload_s < math.inf:
            raise ConfigError(f"a re-plan needs a time >= 0 ({self.at}) and a finite reload time >= 0 "
                              f"({self.reload_s})", key="--reschedule")


def parse_loss(text: str) -> Loss:
    """`NODE[,NODE...]@SECONDS`, as `hetnode sim --lose` takes it."""
    names, at, seconds = text.rpartition("@")
    try:
        when = float(seconds)
    except ValueError:
        when = math.nan
    nodes = tuple(n.strip() for n in names.split(",") if n.strip())
    if not at or not nodes or not when >= 0:
        raise ConfigError(f"--lose takes NODE[,NODE...]@SECONDS (seconds >= 0), not {text!r}", key="--lose")
    return Loss(when, nodes)


def after_loss(plan: PlacementPlan, cluster: ClusterSpec, model: ModelSpec, loss: Loss, how: str, *,
               options: ThunderServeOptions | None = None,
               planner: Callable[[ClusterSpec], PlacementPlan] | None = None, delay_s: float | None = None,
               reload_s: float = RELOAD_S,
               profiles: Callable[[PlacementPlan], ProfileTable] | None = None) -> Replan | None:
    """The re-plan the coordinator makes after `loss` (module docstring): `how` is "lightweight" (what the
    coordinator does for a ThunderServe plan), "full" (a new search over the nodes left) or "none" (no re-plan:
    None). A ThunderServe plan is re-planned by `planner.thunderserve.reschedule.replan` under `options`; any
    other by `planner` over the nodes left. `delay_s` replaces the debounce and the planner's measured time;
    `profiles` gives the table of the new plan's nodes."""
    if how not in RESCHEDULES:
        raise ConfigError(f"--reschedule must be one of {', '.join(RESCHEDULES)}, not {how!r}", key="--reschedule")
    check_loss(loss, cluster, math.inf)
    if how == "none":
        return None
    left = replace(cluster, nodes=tuple(n for n in cluster.nodes if n.name not in set(loss.nodes)))
    began = time.process_time()
    note = ""
    if plan.method == "thunderserve":
        from hetnode.planner.thunderserve.reschedule import replan

        if options is None:
            raise ConfigError("re-planning a ThunderServe plan needs its options (the traffic it plans for)")
        replanned = replan(plan, cluster, left, model, options, light=how == "lightweight")
        new, note = replanned.plan, replanned.why_full if how == "lightweight" else ""
    elif how == "lightweight":
        raise ConfigError(f"lightweight rescheduling is ThunderServe's (§3.4), not {plan.method}'s: use "
                          "--reschedule full or none", key="--reschedule")
    elif planner is None:
        raise ConfigError(f"a full re-plan of a {plan.method} plan needs its planner")
    else:
        new = planner(left)
    planner_s = time.process_time() - began
    at = loss.at + (DEBOUNCE_S + planner_s if delay_s is None else delay_s)
    return Replan(at, new, reload_s, profiles(new) if profiles is not None else None, how, planner_s, note)


def check_loss(loss: Loss, cluster: ClusterSpec, duration_s: float) -> None:
    names = {n.name for n in cluster.nodes}
    unknown = sorted(set(loss.nodes) - names)
    if unknown:
        raise ConfigError(f"cluster {cluster.name} has no node {', '.join(unknown)} to lose", key="--lose")
    if not 0 <= loss.at < duration_s:
        raise ConfigError(f"the loss at {loss.at:g} s is outside the run [0, {duration_s:g}) s", key="--lose")


# -- the executor --------------------------------------------------------------------------------------------


@dataclass
class Transition:
    """What a re-plan does to the simulated nodes: those that keep their shard (with their new role), those that
    drop it, and those it adds (a changed shard, or GPUs that held nothing), which serve once loaded."""

    kept: list[tuple[SimNode, str | None, str | None]]  # with its role before and after
    dropped: list[SimNode]
    added: list[SimNode]
    by_name: dict[str, SimNode]  # the new plan's nodes by name, for its routes
    plan: PlacementPlan  # the new plan, its tensor-parallel stages merged as the simulator serves them
    scheduler: Scheduler | None = None  # the new plan's (a runtime one), serving from the switch on


def transition(old_cells: Mapping[str, tuple[str, ...]], old_ranges: Mapping[str, tuple[int, int]],
               new_cells: Mapping[str, tuple[str, ...]], new_ranges: Mapping[str, tuple[int, int]],
               nodes: Mapping[str, SimNode], lost: Collection[str]) -> tuple[list[str], list[str], list[str]]:
    """Names of the old plan's nodes that keep their shard and those that drop it (neither lost), and of the new
    plan's nodes that load one. A merged tensor-parallel node keeps its shard when its GPUs are the same ones
    and none of them reloads (`reloads`: the same layers): a GPU with its layers but other partners holds
    another slice of their tensors."""
    kept: list[str] = []
    dropped: list[str] = []
    for name, cell in old_cells.items():
        if name not in nodes or set(cell) & set(lost):
            continue
        same = new_cells.get(name) == cell and not reloads(old_ranges[name], new_ranges[name])
        (kept if same else dropped).append(name)
    added = [name for name in new_cells if name not in kept]
    return kept, dropped, added


class SimReplans:
    """Runs a run's losses and re-plan on the simulation (module docstring): registers its event kinds and keeps
    what happened, for the report."""

    def __init__(self, sim: Simulation, coord: SimCoordinator, *, prefill_tokens: int | None) -> None:
        self.sim = sim
        self.coord = coord
        self.prefill_tokens = prefill_tokens
        self.report: list[dict[str, Any]] = []
        self.LOSS = sim.register(self._loss)
        self.REPLAN = sim.register(self._replan)
        self.READY = sim.register(self._ready)
        self.EXPIRE = sim.register(self._expire)
        coord.expire = self._hold_until

    def _hold_until(self, at: float, r: Any) -> None:
        self.sim.events.push(at, self.EXPIRE, r)

    def _expire(self, now: float, r: Any, _: None) -> None:
        self.coord.expired(r, now)

    def lose(self, loss: Loss, nodes: Sequence[SimNode]) -> None:
        self.sim.events.push(loss.at, self.LOSS, loss, list(nodes))

    def replan(self, replan: Replan, change: Transition) -> None:
        self.sim.events.push(replan.at, self.REPLAN, replan, change)

    def _down(self, nodes: Sequence[SimNode], now: float, why: str, *, lost: bool = True) -> list[Any]:
        for node in nodes:
            node.down = True
            node.queue = []
            node.kv_held.clear()
        return self.coord.node_down([n.name for n in nodes], now, why, lost=lost)

    def _loss(self, now: float, loss: Loss, nodes: list[SimNode]) -> None:
        names = ", ".join(loss.nodes)
        moved = self._down(nodes, now, f"{names} went down")
        self.report.append({"event": "loss", "at": now, "gpus": list(loss.nodes), "nodes": [n.name for n in nodes],
                            "requests_moved": len(moved)})

    def _replan(self, now: float, replan: Replan, change: Transition) -> None:
        coord = self.coord
        scheduler = change.scheduler
        assert scheduler is not None
        coord.pending = scheduler
        for node, _, role in change.kept:
            set_cap = getattr(node.policy, "set_prompt_tokens", None)
            if set_cap is not None:  # a phase flip: the node's step setting follows its new role
                set_cap(prompt_tokens_for(role, self.prefill_tokens))
        dropped = ", ".join(n.name for n in change.dropped)
        moved = self._down(change.dropped, now, f"a re-plan dropped the shard of {dropped}",
                           lost=False) if change.dropped else []
        # Every node of the new plan answers its assignment (a round trip); a changed shard after its reload.
        sim = self.sim
        hub = sim.network.coordinator
        answers = [sim.delay(hub, n.index) + sim.delay(n.index, hub) for n in change.by_name.values()]
        ready = now + (replan.reload_s if change.added else 0.0) + max(answers, default=0.0)
        self.report.append({
            "event": "replan", "at": now, "how": replan.how, "planner_s": replan.planner_s, "note": replan.note,
            "plan_notes": list(replan.plan.notes[:1]), "kept": [n.name for n, _, _ in change.kept],
            "flipped": [n.name for n, before, after in change.kept if before != after],
            "dropped": [n.name for n in change.dropped], "reloaded": [n.name for n in change.added],
            "requests_moved": len(moved), "ready_at": ready})
        sim.events.push(ready, self.READY, scheduler, change)

    def _ready(self, now: float, scheduler: Scheduler, change: Transition) -> None:
        for node in change.added:
            node.down = False
        self.coord.by_name = change.by_name
        if self.sim.handoff is not None:
            self.sim.handoff.by_name = change.by_name
        retried = self.coord.switch(scheduler, now)
        self.report.append({"event": "ready", "at": now, "queued_retried": retried})

