"""Which node serves which layers: the plan in use, its version, its history, and which shards are ready.

On every membership change (debounced, since joins come in bursts), and on an operator's request, the
coordinator plans a placement over the up members with the configured method (Helix's max-flow MILP by default,
or a baseline), from the members' reported profiles and the probed links (coordinator/planning.py). If the
layer ranges differ from the plan in use it becomes a new plan version, every member gets its Assignment
(layers, or idle), and the plan is ready once every node holding layers reports ready for that version.

Each request gets its own pipeline from the plan's scheduler (Helix §5: IWRR over the max-flow's edge flows,
masking nodes whose estimated KV is over the high-water mark). A request that finds every candidate masked
waits in the scheduler's bounded queue until a running request finishes; on overflow it is refused with the
queue's reason. Requests admitted under an older plan finish on it or move (sessions.py); their accounting
stays with the scheduler that admitted them.

The runtime plans without partial inference: a node's engine runs its whole shard for every request, so a
pipeline hands over only where one node's range ends and the next one's begins.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field, replace

import trio

from hetnode.coordinator.cronus_scheduler import CronusScheduler
from hetnode.coordinator.ecoserve_scheduler import SLOS, EcoServeScheduler
from hetnode.coordinator.generation import GenerationError
from hetnode.coordinator.planning import live_cluster, live_profiles
from hetnode.coordinator.pool_scheduler import PoolScheduler
from hetnode.coordinator.registry import NodeRecord, Registry
from hetnode.coordinator.routing import Scheduler, make_scheduler, policy_names, scheduler_for
from hetnode.coordinator.scheduler import Decision
from hetnode.coordinator.split_scheduler import SplitScheduler
from hetnode.errors import ConfigError
from hetnode.ids import NodeId
from hetnode.models.config import ModelConfig
from hetnode.planner.cluster import ClusterSpec
from hetnode.planner.cronus_plan import cronus_placement, cronus_splitters
from hetnode.planner.ecoserve_plan import MACRO, N_LOWER, N_UPPER, ecoserve_placement, ecoserve_predictors
from hetnode.planner.layout import Candidate, proportional_layout
from hetnode.planner.model import ModelSpec, from_model_config
from hetnode.planner.placement import PlannerOptions, evaluate, plan_placement
from hetnode.planner.plan import NodePlacement, PlacementPlan
from hetnode.planner.profile import ProfileTable, Workload, kv_tokens
from hetnode.planner.split import split_placement
from hetnode.planner.thunderserve.reschedule import replan
from hetnode.planner.thunderserve.settings import ThunderServeOptions, Traffic
from hetnode.policy.cronus_refit import REFIT_WINDOW
from hetnode.policy.decode_booking import ADMISSION, DECODE_BOOKINGS, HANDOFF
from hetnode.policy.ecoserve import Slos
from hetnode.policy.ecoserve_overall import ScalingTrigger
from hetnode.policy.role_batching import prompt_tokens_for
from hetnode.policy.shards import reloads
from hetnode.policy.workload_monitor import WorkloadMonitor
from hetnode.protocol.messages import Assignment, AssignmentStatus, Load, Route
from hetnode.protocol.routes import route_peers

log = logging.getLogger(__name__)

SendAssignment = Callable[[NodeId, Assignment], Awaitable[bool]]
# Planning assumes weights held in 16-bit: what serving GPUs use (a CPU node in fp32 holds half as many).
PLAN_BYTES_PER_PARAM = 2
# "pipeline" is the simple layout of the inference-path issue: one pipeline through every node, layers in
# proportion to memory bandwidth. Tests that need a multi-stage pipeline on a small cluster ask for it.
# "split" is the first phase-split plan (planner/split.py): prefill and decode replicas, routed by CLS.
# "cronus": pairs of a weak and a strong node, each holding the whole model (planner/cronus_plan.py).
# "thunderserve": ThunderServe's tabu search over phase-split deployments (planner/thunderserve/), routed by its
# orchestration; a node lost or a workload shift reschedules it lightly (its groups kept, phases flipped).
# "ecoserve": every node holding the whole model an instance, in macro-instances (planner/ecoserve_plan.py).
METHODS = ("helix", "petals", "swarm", "sp", "sp+", "pipeline", "split", "cronus", "thunderserve", "ecoserve")
# The methods that follow a shift of the request mix, when --reschedule-shift is set.
_FOLLOW_THE_MIX = ("split", "thunderserve")
# The arrival rate a ThunderServe plan is made for while no request has come in yet.
_RATE_UNSEEN = 1.0
# Kinds of re-plan that ThunderServe answers with its lightweight reschedule rather than a new search.
_LIGHT_KINDS = ("node_lost", "node_left", "node_leaving", "workload_shift")
_WIRE_ROLES = {"ppi": "prefill", "cpi": "mixed"}
_UNSENT = "could not send the assignment"
# Between tries of an assignment that could not be sent: a control stream stalls for seconds on a loaded host.
_RESEND_FIRST_S = 0.5
_RESEND_MAX_S = 8.0


def _check_booking(booking: str, scheduler: str) -> None:
    """Splitwise's pools lend replicas across roles and book at admission: another booking is not theirs."""
    if booking != ADMISSION and scheduler == PoolScheduler.name:
        raise ConfigError(f"--decode-booking {booking} is a setting of the phase-split schedulers cls, tstp and "
                          f"random-pairs, not of {scheduler!r}: Splitwise's pools book at admission",
                          key="decode_booking")


def _books_at_handoff(scheduler: Scheduler | None) -> bool:
    return isinstance(scheduler, SplitScheduler) and scheduler.decode_booking == HANDOFF


def _wire_role(role: str) -> str:
    """The role a node is told: an EcoServe instance (role "macro<k>") runs both phases, as a "mixed" node."""
    return "mixed" if role.startswith(MACRO) else _WIRE_ROLES.get(role, role)


@dataclass(frozen=True)
class PlanningConfig:
    method: str = "helix"  # one of METHODS
    scheduler: str = "iwrr"  # routing policy: iwrr, random, shortest-queue, swarm
    time_limit_s: float = 10.0  # the helix search's budget per re-plan (it runs in a worker thread)
    kv_share: float = 0.5  # share of each node's memory kept for KV (Helix Table 1's rule)
    high_water: float = 0.9  # KV high-water mark of the scheduler's mask
    queue_limit: int = 256  # requests that may wait for KV before new ones are refused
    # The workload a phase-split plan sizes its pools for: prompt and output tokens of a typical request.
    split_workload: tuple[int, int] = (Workload.input_len, Workload.output_len)
    # A phase-split plan is made again for the observed mix when its mean prompt or output length moves by more
    # than this share from what the plan was sized for, over the last `workload_window_s` (0: never); a
    # ThunderServe plan also when the arrival rate moves so from the rate it was made for.
    reschedule_shift: float = 0.0
    workload_window_s: float = 120.0
    # The TTFT and TPOT SLOs in seconds: ThunderServe's orchestration maximizes the share of requests meeting
    # them, EcoServe's Algorithm 2 checks an instance against them.
    slo_s: tuple[float, float] = (SLOS.ttft_s, SLOS.tpot_s)
    # EcoServe's mitosis bounds (N_l, N_u): macro-instances of N_l to N_u instances.
    macro_bounds: tuple[int, int] = (N_LOWER, N_UPPER)
    # EcoServe's mitosis scaling: this many instances serve at first, the rest stay spare (0: all serve, no
    # scaling); once per window the trigger (policy.ecoserve_overall.ScalingTrigger) adds or removes one.
    scale_from: int = 0
    scale_window_s: float = 30.0
    scale_target: float = 0.9
    scale_low_use: float = 0.3
    scale_idle_windows: int = 4
    # Prompt tokens a step of a prefill replica's node batches (policy/role_batching.py); None: no cap. The
    # command line's default is the placement's (`prefill_tokens_of`).
    prefill_tokens: int | None = None
    # When a phase-split plan's scheduler books the decode replica's KV (split_scheduler.py): "admission" (the
    # decode hops reserve before the prefill) or "handoff" (ThunderServe's KV queues: the prefill hops keep the KV
    # until the decode replica has room, and the decode hops reserve then).
    decode_booking: str = ADMISSION

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"unknown placement method {self.method!r}; known: {', '.join(METHODS)}",
                              key="method")
        if self.scheduler not in policy_names():
            raise ConfigError(f"unknown scheduler {self.scheduler!r}; known: {', '.join(policy_names())}",
                              key="scheduler")
        if not self.time_limit_s > 0:
            raise ConfigError(f"time limit must be > 0, not {self.time_limit_s}", key="time_limit_s")
        if not 0 <= self.kv_share < 1:
            raise ConfigError(f"kv share must be in [0, 1), not {self.kv_share}", key="kv_share")
        if self.split_workload[0] < 1 or self.split_workload[1] < 0:
            raise ConfigError(f"split workload must be >= 1 prompt and >= 0 output tokens, not "
                              f"{self.split_workload}", key="split_workload")
        if not (self.slo_s[0] > 0 and self.slo_s[1] > 0):
            raise ConfigError(f"the SLOs must be > 0 seconds, not {self.slo_s}", key="slo_s")
        if not 1 <= self.macro_bounds[0] < self.macro_bounds[1]:
            raise ConfigError(f"EcoServe's macro-instance bounds need 1 <= N_l < N_u, not {self.macro_bounds}",
                              key="macro_bounds")
        if self.scale_from < 0 or not self.scale_window_s > 0 or self.scale_idle_windows < 1:
            raise ConfigError(f"EcoServe's scaling needs --scale-from >= 0 ({self.scale_from}), a window > 0 s "
                              f"({self.scale_window_s}) and >= 1 idle window ({self.scale_idle_windows})",
                              key="scale_from")
        if not (0 < self.scale_target <= 1 and 0 < self.scale_low_use <= 1):
            raise ConfigError(f"the scaling target ({self.scale_target}) and low use ({self.scale_low_use}) are "
                              "shares in (0, 1]", key="scale_target")
        if self.decode_booking not in DECODE_BOOKINGS:
            raise ConfigError(f"decode booking must be one of {', '.join(DECODE_BOOKINGS)}, not "
                              f"{self.decode_booking!r}", key="decode_booking")
        _check_booking(self.decode_booking, self.scheduler)
        if not self.reschedule_shift >= 0 or not self.workload_window_s > 0:
            raise ConfigError(f"the reschedule shift must be >= 0 ({self.reschedule_shift}) and the workload "
                              f"window > 0 ({self.workload_window_s})", key="reschedule_shift")


@dataclass(frozen=True)
class Shard:
    """The layers [first_layer, last_layer) a node holds under a plan (the planner's placement, as assigned)."""

    peer: str
    first_layer: int
    last_layer: int  # exclusive


@dataclass
class Plan:
    version: int
    shards: list[Shard]
    names: list[str]
    reason: str
    created_at: float
    placement: PlacementPlan
    scheduler: Scheduler
    ready: set[NodeId] = field(default_factory=set)
    failed: dict[NodeId, str] = field(default_factory=dict)
    # Nodes whose real KV pool (a heartbeat after their ready report) replaced the planner's estimate.
    kv_reported: set[NodeId] = field(default_factory=set)

    @property
    def is_ready(self) -> bool:
        return len(self.ready) == len(self.shards)

    def peers(self) -> set[NodeId]:
        return {NodeId(s.peer) for s in self.shards}

    def to_json(self) -> dict[str, object]:
        names = {s.peer: n for s, n in zip(self.shards, self.names, strict=True)}
        roles = {n: r.role for r in self.placement.replicas for n in r.nodes}
        return {
            "version": self.version, "reason": self.reason, "created_at": self.created_at, "ready": self.is_ready,
            "kv_reported": self.peers() <= self.kv_reported,
            "shards": [
                {"peer_id": s.peer, "name": n, "first_layer": s.first_layer, "last_layer": s.last_layer,
                 "role": roles.get(s.peer, "mixed"), "ready": NodeId(s.peer) in self.ready,
                 "failed": self.failed.get(NodeId(s.peer))}
                for s, n in zip(self.shards, self.names, strict=True)
            ],
            "method": self.placement.method, "max_flow": self.placement.max_flow,
            "upper_bound": self.placement.upper_bound if math.isfinite(self.placement.upper_bound) else None,
            "status": self.placement.status, "solve_time_s": self.placement.solve_time_s,
            "flows": [{"from": _short(a, names), "to": _short(b, names), "flow": f}
                      for (a, b), f in sorted(self.placement.flows.items()) if f > 0],
            "scheduler": self._scheduler_json(names),
            "replicas": self._replicas_json(names),
            "notes": list(self.placement.notes),  # the planner's own account (a ThunderServe plan's estimates)
        }

    def _scheduler_json(self, names: dict[str, str]) -> dict[str, object]:
        out: dict[str, object] = {"name": type(self.scheduler).name, "queued": self.scheduler.queue_len,
                                  "running": self.scheduler.running}
        if isinstance(self.scheduler, SplitScheduler):
            # When the decode KV is booked, the prefilled requests still waiting for their decode replica's room,
            # and each node's KV pool as the scheduler counts it (the planner's estimate until the node reports
            # its real one).
            out["decode_booking"] = self.scheduler.decode_booking
            out["waiting_handoffs"] = self.scheduler.waiting_handoffs()
            out["kv_capacity"] = {_short(n, names): kv.capacity for n, kv in self.scheduler.kv_estimate().items()}
        return out

    def _replicas_json(self, names: dict[str, str]) -> list[dict[str, object]]:
        """Each replica's role, and under Splitwise's pools its home role and the pool it is in now."""
        out: list[dict[str, object]] = [{"role": r.role, "nodes": [_short(n, names) for n in r.nodes]}
                                        for r in self.placement.replicas]
        if isinstance(self.scheduler, CronusScheduler):  # each pair's balancer, refitted as it serves
            for entry, predictor in zip(out[::2], self.scheduler.predictors(), strict=True):
                entry["balancer"] = predictor
        if isinstance(self.scheduler, EcoServeScheduler):  # the macro-instances as scaling has grouped them now
            now = {n: f"{MACRO}{k}" for k, group in enumerate(self.scheduler.macros()) for n in group}
            for entry, r in zip(out, self.placement.replicas, strict=True):
                entry["macro"] = now.get(r.nodes[0], "spare" if r.nodes[0] in self.scheduler.spare() else "down")
        if isinstance(self.scheduler, PoolScheduler):
            for entry, (home, pool, _) in zip(out, self.scheduler.pools(), strict=True):
                entry["home"], entry["pool"] = home, pool
        orch = self.placement.orchestration
        if orch is not None:  # ThunderServe's routing: the share of requests each replica takes
            prefill = [e for e in out if e["role"] == "prefill"]
            decode = [e for e in out if e["role"] == "decode"]
            for i, entry in enumerate(prefill):
                entry["share"] = orch.prefill_share[i]
            for j, entry in enumerate(decode):
                entry["share"] = sum(x * row[j] for x, row in zip(orch.prefill_share, orch.decode_share, strict=True))
        return out


def replan_kind(reason: str) -> str:
    """The label a re-plan is counted under (/metrics' hetnode_replans_total), from the reasons this module and
    the coordinator daemon give: a bounded set, where the reasons themselves name nodes."""
    if reason == "initial":
        return "initial"
    if reason.startswith("workload shift"):
        return "workload_shift"
    for suffix, kind in ((" joined", "node_joined"), (" leaving", "node_leaving"), (" left", "node_left"),
                         (" lost its control stream", "node_lost"), (" missed the heartbeat deadline", "node_lost")):
        if reason.endswith(suffix):
            return kind
    return "other"


def _short(node: str, names: dict[str, str]) -> str:
    return names.get(node, node)


def _fits(placement: PlacementPlan, spec: ModelSpec, method: str, members: list[NodeRecord]) -> bool:
    """Whether `placement` can serve as it is: made by `method` for this model, every node it places among
    `members`."""
    up = {str(r.peer_id) for r in members}
    return (placement.method == method and placement.model == spec.name and placement.num_layers == spec.num_layers
            and all(p.node in up for p in placement.placements))


class Deployment:
    def __init__(self, registry: Registry, send: SendAssignment, *, model: str, model_config: ModelConfig,
                 coordinator: NodeId, home_region: str = "", debounce_s: float = 0.5,
                 planning: PlanningConfig | None = None) -> None:
        self.registry = registry
        self.send = send
        self.model = model
        self.model_config = model_config
        self.coordinator = coordinator
        self.home_region = home_region
        self.debounce_s = debounce_s
        self.planning = planning or PlanningConfig()
        self.spec: ModelSpec = from_model_config(model, model_config, bytes_per_param=PLAN_BYTES_PER_PARAM)
        self.plan: Plan | None = None  # the newest plan (its shards may still be loading)
        self.serving: Plan | None = None  # the newest plan that was ever ready: it serves until the next one is
        self.history: list[dict[str, object]] = []
        self.problem = "no nodes have joined yet"
        self._versions = 0
        self._dirty = trio.Event()
        self._changed = trio.Event()
        self._pending_reason = "initial"
        self.replans: Counter[str] = Counter()  # new plan versions by replan_kind, since start (for /metrics)
        self.scaling: list[dict[str, object]] = []  # EcoServe's mitosis changes, newest last (GET /v1/plan)
        self._pending_method: str | None = None
        self._planning = trio.Lock()
        # Assignments that could not be sent, by node: they go again (run_resends) while they are current.
        self._unsent: dict[NodeId, Assignment] = {}
        self._unsent_added = trio.Event()
        # Requests routed by a scheduler, by session: the scheduler to tell when the session ends.
        self._routed: dict[str, Scheduler] = {}
        # Queued requests: the event that wakes them, and what they got (a pipeline, or why not).
        self._waiting: dict[str, tuple[Scheduler, trio.Event]] = {}
        self._outcome: dict[str, Route | str] = {}
        # The requests' lengths and arrivals (GET /v1/plan; a phase-split plan follows a shift of the mix, and a
        # ThunderServe plan, whose orchestration is solved for a rate, a shift of the arrival rate too).
        self.workload = WorkloadMonitor(self.planning.split_workload, window_s=self.planning.workload_window_s,
                                        shift=self.planning.reschedule_shift or 0.5,
                                        rate=_RATE_UNSEEN if self.planning.method == "thunderserve" else None)
        # Told each plan that starts serving (a coordinator with --state-dir saves it).
        self.on_serving: Callable[[Plan], None] | None = None
        # Told each request whose KV hand-off may start now (a scheduler that books the decode KV at the
        # hand-off names them: `take_handoffs`); the generator then has the decode hops reserve.
        self.on_handoff: Callable[[str], None] | None = None
        # The plan that served before a restart, served again once its nodes are back (restore()).
        self._restored: PlacementPlan | None = None
        self._restore_wait_s = 0.0

    def restore(self, placement: PlacementPlan, version: int, wait_s: float) -> None:
        """Serve `placement` again, the plan that served before this coordinator restarted: its nodes still hold
        their shards, so they are ready at once, where a new plan (the helix search is not deterministic in
        time) would make most of them reload. The first plan waits up to `wait_s` for those nodes to rejoin;
        if one is missing by then, or the method has changed, the coordinator plans anew."""
        self._restored = placement
        self._versions = max(self._versions, version)
        self._restore_wait_s = wait_s

    def request_arrived(self, input_len: int) -> None:
        """A request came in (not a move of one): its prompt length joins the window; a phase-split deployment
        whose mix has shifted is planned again for the observed one."""
        now = trio.current_time()
        self.workload.arrived(now, input_len)
        if self.planning.method not in _FOLLOW_THE_MIX or not self.planning.reschedule_shift:
            return
        why = self.workload.shifted(now)
        if why:
            prompt, output = self.workload.rebase(now)
            self.planning = replace(self.planning, split_workload=(max(1, round(prompt)), max(0, round(output))))
            log.info("workload shift (%s): planning the phase-split deployment again", why)
            # ThunderServe re-plans at the window's rate (`_thunderserve`); the split planner reads no rate, and
            # the monitor judges none for it, so a rate shift alone never re-plans a split deployment.
            self.membership_changed(f"workload shift: {why}")

    def request_finished(self, output_len: int) -> None:
        self.workload.finished(trio.current_time(), output_len)

    def membership_changed(self, reason: str) -> None:
        self._pending_reason = reason
        self._dirty.set()

    async def run(self) -> None:
        restored = self._restored
        if restored is not None:
            with trio.move_on_after(self._restore_wait_s):
                while not _fits(restored, self.spec, self.planning.method, self.registry.up_members()):
                    await self._dirty.wait()
                    self._dirty = trio.Event()
            self._pending_reason = "restored after a coordinator restart"
            self._dirty.set()
        while True:
            await self._dirty.wait()
            # Joins and leaves come in bursts (a testnet starting): plan once for the burst.
            await trio.sleep(self.debounce_s)
            self._dirty = trio.Event()
            await self.replan(self._pending_reason, kind=replan_kind(self._pending_reason))

    async def run_scaling(self) -> None:
        """EcoServe's mitosis (`--scale-from`): at the end of each window the routing plan's scheduler judges it,
        and may add a spare instance or remove one. The call is timed: it is all the pause routing sees while
        instances move between macro-instances (their nodes are told nothing and serve on)."""
        if not self.planning.scale_from:
            return
        while True:
            await trio.sleep(self.planning.scale_window_s)  # a period, not a wait for something to happen
            plan = self._usable(())
            if plan is None or not isinstance(plan.scheduler, EcoServeScheduler) or plan.scheduler.scaler is None:
                continue
            now = trio.current_time()
            started = time.perf_counter()
            change, admitted = plan.scheduler.scale(now)
            pause = time.perf_counter() - started
            if change is None:
                continue
            names = {str(p): r.name for p, r in self.registry.nodes.items()}
            entry = {"at": time.time(), "plan": plan.version, "action": change.action,
                     "instance": names.get(str(change.instance), str(change.instance)),
                     "attainment": change.attainment, "utilization": change.utilization,
                     "sizes": list(change.sizes), "pause_s": pause,
                     "moves": [{"instance": names.get(str(m.instance), str(m.instance)), "from": m.source,
                                "to": m.target} for m in change.moves]}
            self.scaling.append(entry)
            del self.scaling[:-100]
            log.info("mitosis: %s %s (attainment %.2f, utilization %.2f): macro-instances %s, %d moved, "
                     "routing paused %.1f us", change.action, entry["instance"], change.attainment,
                     change.utilization, list(change.sizes), len(change.moves), pause * 1e6)
            self._wake(plan.scheduler, admitted, now)
            self._notify()

    async def replan(self, reason: str, method: str | None = None, *, kind: str = "operator") -> Plan | None:
        """Plan over the up members; `method` (an operator's request) becomes the method from now on. `kind`
        (`replan_kind`) counts a new plan version in `replans`."""
        async with self._planning:
            if method is not None:
                self.planning = PlanningConfig(**{**self.planning.__dict__, "method": method})
            return await self._replan(reason, kind)

    async def _replan(self, reason: str, kind: str = "operator") -> Plan | None:
        members = self.registry.up_members()
        try:
            placement, profiles = await self._place(members, kind)
        except ConfigError as exc:
            self._no_plan(exc)
            return None
        # The members may have changed while the planner ran: plan again on the next round if so.
        placed = {p.node for p in placement.placements}
        members = [r for r in self.registry.up_members() if str(r.peer_id) in placed or r in members]
        shards = sorted((Shard(peer=p.node, first_layer=p.first_layer, last_layer=p.last_layer)
                         for p in placement.placements), key=lambda s: (s.first_layer, s.last_layer, s.peer))
        if (self.plan is not None and self.plan.shards == shards and self.plan.placement.method == placement.method
                and not self.plan.scheduler.down):
            # The same layout, but a member that joined again (a restarted node) lost its shard: assign it anew.
            await self._assign(self.plan, [r for r in members if r.assignment is None])
            self._notify()
            return self.plan
        try:
            # A plan no scheduler can route (one that an operator's --scheduler does not fit, nodes without a
            # profile to fit predictors on) is no plan: the serving one goes on, and the reason is shown.
            scheduler = make_scheduler(
                scheduler_for(placement, self.planning.scheduler), placement, seed=self._versions + 1,
                high_water=self.planning.high_water, queue_limit=self.planning.queue_limit,
                kv_capacity={p.node: kv_tokens(profiles.profiles[p.node].memory_bytes, self.spec, p.layers)
                             for p in placement.placements},
                **self._live_inputs(placement, profiles))
        except ConfigError as exc:
            self._no_plan(exc)
            return None
        self._versions += 1
        self.replans[kind] += 1
        names = [self.registry.nodes[NodeId(s.peer)].name for s in shards]
        plan = Plan(self._versions, shards, names, reason, time.time(), placement, scheduler)
        if self.plan is not self.serving:
            self._retire(self.plan)  # replaced before it was ever ready
        self.plan = plan
        self.problem = ""
        described = [f"{n}[{s.first_layer},{s.last_layer})" for s, n in zip(shards, names, strict=True)]
        self.history.append({"version": plan.version, "reason": reason, "at": plan.created_at,
                             "method": placement.method, "max_flow": placement.max_flow, "shards": described})
        del self.history[:-100]
        log.info("plan %d (%s; %s, %s): %s", plan.version, reason, placement.method, placement.size,
                 ", ".join(described))
        await self._assign(plan, members)
        if self.serving is not None and self.serving is not plan:
            # Nodes the new plan leaves idle drop their shard at once: the serving plan can no longer use them.
            for peer in self.serving.peers() - plan.peers():
                self._mask(self.serving, peer)
        self._notify()
        return plan

    def _no_plan(self, why: ConfigError) -> None:
        self.problem = f"no plan: {why}"
        log.warning("%s", self.problem)
        self._retire(self.plan)
        self.plan = None
        self._notify()

    def _live_inputs(self, placement: PlacementPlan, profiles: ProfileTable) -> dict[str, object]:
        """What the baseline policies read from the nodes, as the simulator feeds them from its nodes: the
        tokens waiting in each node's queue (shortest-queue) and each node's measured step throughput, its T_j
        until it has measured one (swarm); both from the nodes' latest heartbeats."""
        if placement.method == "ecoserve":
            return {"predictors": ecoserve_predictors(placement, self.spec, {
                str(r.peer_id): r.profile for r in self.registry.nodes.values()}),
                "lower": self.planning.macro_bounds[0], "upper": self.planning.macro_bounds[1],
                "slos": Slos(*self.planning.slo_s), **self._scaling(placement)}
        if placement.method == "cronus":
            return {"splitters": cronus_splitters(placement, self.spec, {
                str(r.peer_id): r.profile for r in self.registry.nodes.values()}), "refit_window": REFIT_WINDOW}
        if placement.replicas:
            inputs: dict[str, object] = {"regions": {str(r.peer_id): r.region for r in self.registry.nodes.values()}}
            if self.planning.decode_booking != ADMISSION:
                _check_booking(self.planning.decode_booking, scheduler_for(placement, self.planning.scheduler))
                inputs["decode_booking"] = self.planning.decode_booking
            return inputs

        def load(node: str) -> Load:
            record = self.registry.nodes.get(NodeId(node))
            return record.load if record is not None else Load()

        if self.planning.scheduler == "shortest-queue":
            return {"queue_len": lambda node: float(load(node).queued_tokens)}
        if self.planning.scheduler == "swarm":
            planned = {p.node: profiles.profiles[p.node].tokens_per_s(p.layers) for p in placement.placements}
            return {"throughput": lambda node: load(node).tokens_per_s or planned.get(node, 0.0)}
        return {}

    def _scaling(self, placement: PlacementPlan) -> dict[str, object]:
        """An EcoServe scheduler's mitosis (`--scale-from`): its trigger, and the instances that serve at first:
        those that served under the previous plan, so that a re-plan (a node joined or left) does not undo the
        scaling (a node that joins is spare until the trigger adds it); on the first plan the first
        `scale_from` in name order."""
        if not self.planning.scale_from:
            return {}
        instances = sorted(r.nodes[0] for r in placement.replicas)  # an instance is named by its first node
        before = self.plan.scheduler if self.plan is not None else None
        active = sorted(before.active & set(instances)) if isinstance(before, EcoServeScheduler) else []
        p = self.planning
        return {"trigger": ScalingTrigger(p.scale_target, p.scale_low_use, p.scale_idle_windows),
                "active": active or instances[:p.scale_from], "since": trio.current_time()}

    async def _place(self, members: list[NodeRecord], kind: str = "operator") -> tuple[PlacementPlan, ProfileTable]:
        profiles, skipped = live_profiles(members, self.spec, kv_share=self.planning.kv_share)
        for peer, why in skipped.items():
            log.info("node %s holds no layers: %s", self.registry.nodes[NodeId(peer)].name, why)
        usable = [r for r in members if str(r.peer_id) in profiles.profiles]
        if not usable:
            raise ConfigError("no up member can hold a layer" if members else "no nodes are up")
        cluster = live_cluster(self.registry, self.coordinator, self.home_region, usable)
        restored, self._restored = self._restored, None  # once: later plans follow the members
        # Only a ThunderServe plan is made for a rate (`_thunderserve` states it); a restored plan's is not known.
        self.workload.planned_at(None)
        if restored is not None:
            if _fits(restored, self.spec, self.planning.method, usable):
                return self._served_again(restored, cluster, profiles), profiles
            log.info("not serving the plan from before the restart: %s", "the method changed"
                     if restored.method != self.planning.method else "some of its nodes did not come back")
        if self.planning.method == "pipeline":
            return self._pipeline_placement(usable, cluster, profiles), profiles
        if self.planning.method == "cronus":
            return cronus_placement(cluster.name, self.spec, {str(r.peer_id): r.profile.matmul_tflops for r in usable},
                                    {str(r.peer_id): r.profile.memory_bytes for r in usable}), profiles
        if self.planning.method == "thunderserve":
            return await self._thunderserve(usable, cluster, kind), profiles
        if self.planning.method == "ecoserve":
            lower, upper = self.planning.macro_bounds
            return ecoserve_placement(cluster.name, self.spec, {str(r.peer_id): r.profile.memory_bytes for r in usable},
                                      lower=lower, upper=upper), profiles
        if self.planning.method == "split":
            prompt, output = self.planning.split_workload
            return split_placement(cluster, self.spec, profiles,
                                   workload=Workload(input_len=prompt, output_len=output)), profiles
        options = PlannerOptions(time_limit_s=self.planning.time_limit_s, partial_inference=False, seed=0)
        # The helix search takes up to its time limit: off the event loop, so serving goes on meanwhile.
        placement = await trio.to_thread.run_sync(functools.partial(
            plan_placement, cluster, self.spec, profiles, method=self.planning.method, options=options))
        return placement, profiles

    async def _thunderserve(self, usable: list[NodeRecord], cluster: ClusterSpec, kind: str) -> PlacementPlan:
        """ThunderServe's search over the up members; after a loss or a shift of the mix, its lightweight
        reschedule of the plan in use instead (§3.4: surviving groups keep their layers, phases may flip), unless
        no group of it survives or a node it does not know has joined."""
        prompt, output = self.planning.split_workload
        now = trio.current_time()
        rate = self.workload.mix(now).rate or _RATE_UNSEEN
        # The lengths' spread as the window has seen it (none seen: every request of the configured lengths)
        input_cv, output_cv = self.workload.spread(now)
        traffic = Traffic(input_len=prompt, output_len=max(1, output), rate=rate, input_cv=input_cv,
                          output_cv=output_cv)
        options = ThunderServeOptions(traffic=traffic, slo_s=self.planning.slo_s)
        self.workload.planned_at(rate)  # a shift of the arrival rate is judged against this one from now on
        current = self.plan.placement if self.plan is not None else None
        # The plan's own cluster (its nodes, gone ones included), to read its layouts back from.
        records = [] if current is None else [self.registry.nodes[NodeId(n)] for r in current.replicas
                                              for n in r.nodes if NodeId(n) in self.registry.nodes]
        replanned = await trio.to_thread.run_sync(functools.partial(
            replan, current, live_cluster(self.registry, self.coordinator, self.home_region, records), cluster,
            self.spec, options, light=kind in _LIGHT_KINDS))
        if replanned.why_full and kind in _LIGHT_KINDS and current is not None:
            log.info("no lightweight reschedule (%s)", replanned.why_full)
        placement = replanned.plan
        if any(r.tp > 1 for r in placement.replicas):
            raise ConfigError("the ThunderServe plan uses tensor parallelism, which the runtime does not have")
        return placement

    def _served_again(self, restored: PlacementPlan, cluster: ClusterSpec, profiles: ProfileTable) -> PlacementPlan:
        """The restored plan's layers with flows recomputed over today's links (a replica plan routes by its
        replicas, not by flows, and is kept as it was)."""
        if restored.replicas:
            return restored
        ranges = {p.node: (p.first_layer, p.last_layer) for p in restored.placements}
        flow = evaluate(cluster, self.spec, profiles, ranges, partial=False)
        return replace(restored, flows=dict(flow.flows), max_flow=flow.value,
                       notes=(*restored.notes, "restored after a coordinator restart"))

    def _pipeline_placement(self, usable: list[NodeRecord], cluster: ClusterSpec, profiles: ProfileTable,
                            ) -> PlacementPlan:
        candidates = [Candidate(str(r.peer_id), r.region, r.profile.mem_bandwidth_gbps, r.profile.memory_bytes)
                      for r in usable]
        layout = proportional_layout(candidates, self.model_config.num_layers, int(self.spec.layer_bytes),
                                     home_region=self.home_region)
        ranges = {p.node: (p.first_layer, p.last_layer) for p in layout}
        flow = evaluate(cluster, self.spec, profiles, ranges, partial=False)
        return PlacementPlan(cluster=cluster.name, model=self.spec.name, num_layers=self.spec.num_layers,
                             method="pipeline", placements=tuple(NodePlacement(n, *r) for n, r in ranges.items()),
                             flows=dict(flow.flows), max_flow=flow.value, status="heuristic",
                             partial_inference=False)

    def _retire(self, plan: Plan | None) -> None:
        """Queued requests of a replaced plan try again on the new one."""
        if plan is None:
            return
        for key, (scheduler, event) in list(self._waiting.items()):
            if scheduler is plan.scheduler:
                scheduler.cancel(key)
                del self._waiting[key]
                event.set()

    async def _assign(self, plan: Plan, members: list[NodeRecord]) -> None:
        by_peer = {NodeId(s.peer): s for s in plan.shards}
        # A node's role on the wire is the phase it runs: Cronus's PPI prefills, its CPI finishes and decodes.
        roles = {NodeId(n): _wire_role(r.role) for r in plan.placement.replicas for n in r.nodes}
        for r in members:
            s = by_peer.get(r.peer_id)
            role = roles.get(r.peer_id, "mixed") if s else "idle"
            a = Assignment(plan_version=plan.version, model=self.model,
                           first_layer=s.first_layer if s else 0, last_layer=s.last_layer if s else 0,
                           role=role,  # type: ignore[arg-type]
                           prompt_tokens=prompt_tokens_for(role, self.planning.prefill_tokens))
            r.assignment, r.assignment_state = a, "sent"
            plan.ready.discard(r.peer_id)
            if await self.send(r.peer_id, a):
                self._unsent.pop(r.peer_id, None)
                continue
            self._unsent[r.peer_id] = a
            self._unsent_added.set()
            if s is not None:
                plan.failed[r.peer_id] = _UNSENT

    async def run_resends(self) -> None:
        """Assignments that could not be sent go again, backing off, while they are their node's newest and the
        node a member: a control stream that stalled for a moment (a loaded host) must not leave a plan waiting
        for a node that never heard of it."""
        delay = _RESEND_FIRST_S
        while True:
            if not self._unsent:
                await self._unsent_added.wait()
                self._unsent_added = trio.Event()
                delay = _RESEND_FIRST_S
                continue
            await trio.sleep(delay)  # a backoff between tries, not a wait for something to happen
            delay = min(2 * delay, _RESEND_MAX_S)
            for peer, a in list(self._unsent.items()):
                record = self.registry.nodes.get(peer)
                if record is None or record.assignment is not a or not self.registry.is_member(peer):
                    del self._unsent[peer]  # replaced by a newer assignment, or the node is gone
                    continue
                if not await self.send(peer, a) or self._unsent.get(peer) is not a:
                    continue
                del self._unsent[peer]
                log.info("assignment of plan %d reached %s on a later try", a.plan_version, record.name)
                plan = self.plan
                if plan is not None and plan.version == a.plan_version and plan.failed.get(peer) == _UNSENT:
                    del plan.failed[peer]
                    self._notify()

    # -- routing -----------------------------------------------------------------------------------------

    async def route(self, key: str, input_len: int, avoid: Collection[NodeId] = ()) -> Route:
        """A pipeline for one request (session `key`) from the ready plan's scheduler; waits for a ready plan
        and, while every candidate is over its KV high-water mark, in the scheduler's queue. Raises
        GenerationError when the scheduler refuses the request (its queue is full, or it can never fit)."""
        while True:
            plan = await self.wait_ready(math.inf, avoid)
            assert plan is not None  # an unbounded wait returns only with a plan
            decision = plan.scheduler.submit(key, input_len, trio.current_time())
            if decision.route is not None:
                self._routed[key] = plan.scheduler
                return decision.route
            if decision.too_large:  # no retry can help: the client must send less
                raise GenerationError(decision.reason, status=400, code="kv_capacity_exceeded")
            if not decision.queued:
                full = decision.reason.startswith("queue full")
                raise GenerationError(f"the scheduler refused the request: {decision.reason}",
                                      status=429 if full else 503, code="queue_full" if full else "no_capacity")
            event = trio.Event()
            self._waiting[key] = (plan.scheduler, event)
            try:
                await event.wait()
            finally:
                if self._waiting.pop(key, None) is not None:  # cancelled while queued
                    plan.scheduler.cancel(key)
            outcome = self._outcome.pop(key, None)
            if isinstance(outcome, Route):
                if not any(NodeId(p) in avoid or not self.registry.is_member(NodeId(p)) for p in route_peers(outcome)):
                    return outcome
                self.route_done(key, None)
            elif isinstance(outcome, str):
                raise GenerationError(f"the scheduler refused the request: {outcome}", status=503,
                                      code="no_capacity")
            # None: the plan changed while it waited; try the new one.

    def route_prefilled(self, key: str) -> None:
        """The session `key` has its first token: a phase-split scheduler frees its prefill replica."""
        scheduler = self._routed.get(key)
        if scheduler is not None:
            now = trio.current_time()
            self._wake(scheduler, scheduler.prefilled(key, now), now)

    def route_partial_done(self, key: str) -> None:
        """The earlier phases of session `key` are done with it (every hop of them handed its KV on)."""
        scheduler = self._routed.get(key)
        if scheduler is not None:
            now = trio.current_time()
            self._wake(scheduler, scheduler.partial_done(key, now), now)

    def books_at_handoff(self, key: str) -> bool:
        """Whether the scheduler that routed session `key` books its decode KV at the hand-off ("handoff"): its
        prefill hops then keep the KV until `on_handoff` names it."""
        return _books_at_handoff(self._routed.get(key))

    def route_progress(self, key: str, output_len: int) -> None:
        """The session `key` has generated `output_len` tokens (EcoServe's saved TPOT reads decodes' progress)."""
        scheduler = self._routed.get(key)
        if scheduler is not None:
            scheduler.progress(key, output_len, trio.current_time())

    def route_done(self, key: str, output_len: int | None) -> None:
        """The session `key` ended: after `output_len` generated tokens, or moved away (None)."""
        scheduler = self._routed.pop(key, None)
        if scheduler is None:
            return
        now = trio.current_time()
        admitted = scheduler.cancel(key, now) if output_len is None else scheduler.finish(key, output_len, now)
        self._wake(scheduler, admitted, now)

    def on_load(self, peer: NodeId, load: Load) -> None:
        """A heartbeat's load: a node of the plan that is ready reports its real KV pool, which replaces the
        planner's estimate in the scheduler (that estimate was what let through a prompt no pool could hold)."""
        plan = self.plan
        total = load.kv_blocks_used + load.kv_blocks_free
        # Before its ready status the node may still report the pool of its previous shard.
        if plan is None or peer not in plan.ready or not load.kv_block_size or not total:
            return
        now = trio.current_time()
        self._wake(plan.scheduler, plan.scheduler.set_capacity(str(peer), total * load.kv_block_size, now), now)
        if peer not in plan.kv_reported:
            plan.kv_reported.add(peer)
            self._notify()  # (GET /v1/plan?kv_reported=true waits for every node's)

    def _wake(self, scheduler: Scheduler, admitted: list[Decision], now: float) -> None:
        """Hand queued requests that the scheduler let go (started or refused) to their waiters; then the
        hand-offs it lets start (every call that can free KV ends here, as the simulated coordinator's
        `_admit_queued` does)."""
        for d in admitted:
            waiting = self._waiting.pop(d.request_id, None)
            if waiting is None:
                scheduler.cancel(d.request_id, now)  # its waiter is gone
                continue
            if d.route is not None:
                self._routed[d.request_id] = scheduler
                self._outcome[d.request_id] = d.route
            else:
                self._outcome[d.request_id] = d.reason
            waiting[1].set()
        if not _books_at_handoff(scheduler):
            return
        assert isinstance(scheduler, SplitScheduler)
        for key in scheduler.take_handoffs():
            if self._routed.get(key) is scheduler and self.on_handoff is not None:
                self.on_handoff(key)

    def on_status(self, peer: NodeId, status: AssignmentStatus) -> None:
        plan = self.plan
        if plan is None or status.plan_version != plan.version or peer not in plan.peers():
            return
        if status.state == "ready":
            plan.ready.add(peer)
            if self.serving is not None and self.serving is not plan and peer in self.serving.peers():
                old = next(h for h in self.serving.shards if NodeId(h.peer) == peer)
                new = next(h for h in plan.shards if NodeId(h.peer) == peer)
                if reloads((old.first_layer, old.last_layer), (new.first_layer, new.last_layer)):
                    self._mask(self.serving, peer)  # its old shard is gone: no new request through it there
            plan.failed.pop(peer, None)
            if plan.is_ready and self.serving is not plan:
                log.info("plan %d ready", plan.version)
                old, self.serving = self.serving, plan
                self._retire(old)  # its queued requests try the new plan; its running ones finish where they are
                if self.on_serving is not None:
                    self.on_serving(plan)
        elif status.state == "failed":
            plan.ready.discard(peer)
            plan.failed[peer] = status.detail or "failed"
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_ready(self, timeout_s: float, avoid: Collection[NodeId] = ()) -> Plan | None:
        """The ready plan whose nodes are all up and none in `avoid`, waiting up to timeout_s for one (and for
        a pending re-plan, which may change it); None if there is none by then."""
        with trio.move_on_after(timeout_s):
            while self._usable(avoid) is None:
                await self._changed.wait()
        return self._usable(avoid)

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Wait (bounded) until predicate() holds, re-checking on every change of the plans; its final value."""
        with trio.move_on_after(timeout_s):
            while not predicate():
                await self._changed.wait()
        return predicate()

    async def wait_serving(self, plan: Plan, timeout_s: float) -> bool:
        """Until `plan` is the one that serves (all its shards ready); False if it is not by the timeout."""
        with trio.move_on_after(timeout_s):
            while self.serving is not plan:
                await self._changed.wait()
        return self.serving is plan

    def _usable(self, avoid: Collection[NodeId]) -> Plan | None:
        """The plan to route by: the newest once it is ready; until then the one that served before (a re-plan
        never stalls new requests). Nodes that went down are masked by its scheduler; the plan is unusable only
        when no pipeline of up nodes is left, or it uses a node the caller must avoid."""
        plan = self.plan if self.plan is not None and self.plan.is_ready else self.serving
        if plan is None or plan.scheduler.largest_kv == -math.inf:
            return None
        if any(p in avoid and str(p) not in plan.scheduler.down for p in plan.peers()):
            return None  # (a node its scheduler has masked is never on a route it gives)
        return plan

    def node_down(self, peer: NodeId) -> None:
        """Mask a node that went down in the schedulers of the plans in use: the rest keeps serving meanwhile."""
        for plan in {id(p): p for p in (self.plan, self.serving) if p is not None}.values():
            self._mask(plan, peer)
        self._notify()

    def _mask(self, plan: Plan, peer: NodeId) -> None:
        if peer in plan.peers():
            now = trio.current_time()
            self._wake(plan.scheduler, list(plan.scheduler.node_down(str(peer), now).rejected), now)

    def why_not_ready(self) -> str:
        if self.plan is None:
            return self.problem or "no plan yet"
        waiting = [n for s, n in zip(self.plan.shards, self.plan.names, strict=True)
                   if NodeId(s.peer) not in self.plan.ready]
        failed = "; ".join(f"{self.registry.nodes[p].name}: {why}" for p, why in self.plan.failed.items()
                           if p in self.registry.nodes)
        return f"plan {self.plan.version} waits for {', '.join(waiting)}" + (f" ({failed})" if failed else "")

    def to_json(self) -> dict[str, object]:
        now = trio.current_time()
        mix = self.workload.mix(now)
        input_cv, output_cv = self.workload.spread(now)
        return {"model": self.model, "num_layers": self.model_config.num_layers,
                "plan": self.plan.to_json() if self.plan else None, "problem": self.problem,
                "history": self.history, "scaling": self.scaling,
                "workload": {"window_s": mix.window_s, "arrivals": mix.arrivals, "finished": mix.finished,
                             "rate": mix.rate, "mean_input": mix.mean_input, "mean_output": mix.mean_output,
                             "input_cv": input_cv, "output_cv": output_cv,
                             "planned_for": list(self.workload.baseline), "planned_rate": self.workload.rate}}
