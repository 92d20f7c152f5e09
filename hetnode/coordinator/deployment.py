"""Which node serves which layers: the plan in use, its version, its history, and which stages are ready.

On every membership change (debounced, since joins come in bursts) the coordinator computes a layout over
the up members; if it differs from the plan in use it becomes a new plan version, every member gets its
Assignment (layers and role, or idle), and the plan is ready once every stage reports ready for that version.
Requests take the ready plan's pipeline. (The Helix planner issue replaces the layout with max-flow placement
and many pipelines.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

import trio

from hetnode.coordinator.registry import NodeRecord, Registry
from hetnode.errors import ConfigError
from hetnode.ids import NodeId
from hetnode.models.config import ModelConfig
from hetnode.planner.costmodel import layer_shape
from hetnode.planner.layout import Candidate, proportional_layout
from hetnode.protocol.messages import Assignment, AssignmentStatus, Stage

log = logging.getLogger(__name__)

SendAssignment = Callable[[NodeId, Assignment], Awaitable[bool]]
# Planning assumes weights held in 16-bit: what serving GPUs use (a CPU node in fp32 holds half as many).
PLAN_BYTES_PER_PARAM = 2


@dataclass
class Plan:
    version: int
    stages: list[Stage]
    names: list[str]
    reason: str
    created_at: float
    ready: set[NodeId] = field(default_factory=set)
    failed: dict[NodeId, str] = field(default_factory=dict)

    @property
    def is_ready(self) -> bool:
        return len(self.ready) == len(self.stages)

    def peers(self) -> set[NodeId]:
        return {NodeId(s.peer) for s in self.stages}

    def to_json(self) -> dict[str, object]:
        return {
            "version": self.version, "reason": self.reason, "created_at": self.created_at, "ready": self.is_ready,
            "stages": [
                {"peer_id": s.peer, "name": n, "first_layer": s.first_layer, "last_layer": s.last_layer,
                 "ready": NodeId(s.peer) in self.ready, "failed": self.failed.get(NodeId(s.peer))}
                for s, n in zip(self.stages, self.names, strict=True)
            ],
        }


class Deployment:
    def __init__(self, registry: Registry, send: SendAssignment, *, model: str, model_config: ModelConfig,
                 home_region: str = "", debounce_s: float = 0.5) -> None:
        self.registry = registry
        self.send = send
        self.model = model
        self.model_config = model_config
        self.home_region = home_region
        self.debounce_s = debounce_s
        self.layer_bytes = layer_shape(model_config).params * PLAN_BYTES_PER_PARAM
        self.plan: Plan | None = None
        self.history: list[dict[str, object]] = []
        self.problem = "no nodes have joined yet"
        self._versions = 0
        self._dirty = trio.Event()
        self._changed = trio.Event()
        self._pending_reason = "initial"

    def membership_changed(self, reason: str) -> None:
        self._pending_reason = reason
        self._dirty.set()

    async def run(self) -> None:
        while True:
            await self._dirty.wait()
            # Joins and leaves come in bursts (a testnet starting): plan once for the burst.
            await trio.sleep(self.debounce_s)
            self._dirty = trio.Event()
            await self.replan(self._pending_reason)

    async def replan(self, reason: str) -> None:
        members = self.registry.up_members()
        candidates = [Candidate(r.peer_id, r.region, r.profile.mem_bandwidth_gbps, r.profile.memory_bytes)
                      for r in members]
        try:
            layout = proportional_layout(candidates, self.model_config.num_layers, self.layer_bytes,
                                         home_region=self.home_region)
        except ConfigError as exc:
            self.problem = f"no plan: {exc}"
            log.warning("%s", self.problem)
            self.plan = None
            self._notify()
            return
        stages = [Stage(peer=p.node, first_layer=p.first_layer, last_layer=p.last_layer) for p in layout]
        if self.plan is not None and self.plan.stages == stages:
            # The same layout, but a member that joined again (a restarted node) lost its shard: assign it anew.
            await self._assign(self.plan, [r for r in members if r.assignment is None])
            self._notify()
            return
        self._versions += 1
        names = [self.registry.nodes[NodeId(s.peer)].name for s in stages]
        plan = Plan(self._versions, stages, names, reason, time.time())
        self.plan = plan
        self.problem = ""
        described = [f"{n}[{s.first_layer},{s.last_layer})" for s, n in zip(stages, names, strict=True)]
        self.history.append({"version": plan.version, "reason": reason, "at": plan.created_at, "stages": described})
        del self.history[:-100]
        log.info("plan %d (%s): %s", plan.version, reason, " -> ".join(described))
        await self._assign(plan, members)
        self._notify()

    async def _assign(self, plan: Plan, members: list[NodeRecord]) -> None:
        by_peer = {NodeId(s.peer): s for s in plan.stages}
        for r in members:
            s = by_peer.get(r.peer_id)
            a = Assignment(plan_version=plan.version, model=self.model,
                           first_layer=s.first_layer if s else 0, last_layer=s.last_layer if s else 0,
                           role="mixed" if s else "idle")
            r.assignment, r.assignment_state = a, "sent"
            plan.ready.discard(r.peer_id)
            if not await self.send(r.peer_id, a) and s is not None:
                plan.failed[r.peer_id] = "could not send the assignment"

    def on_status(self, peer: NodeId, status: AssignmentStatus) -> None:
        plan = self.plan
        if plan is None or status.plan_version != plan.version or peer not in plan.peers():
            return
        if status.state == "ready":
            plan.ready.add(peer)
            plan.failed.pop(peer, None)
            if plan.is_ready:
                log.info("plan %d ready", plan.version)
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
            while self._dirty.is_set() or self._usable(avoid) is None:
                await self._changed.wait()
        return self._usable(avoid)

    def _usable(self, avoid: Collection[NodeId]) -> Plan | None:
        plan = self.plan
        if plan is None or not plan.is_ready:
            return None
        # A node marked down leaves the plan "ready" until the debounced re-plan replaces it: never hand it out.
        if any(p in avoid or not self.registry.is_member(p) for p in plan.peers()):
            return None
        return plan

    def why_not_ready(self) -> str:
        if self.plan is None:
            return self.problem or "no plan yet"
        waiting = [n for s, n in zip(self.plan.stages, self.plan.names, strict=True)
                   if NodeId(s.peer) not in self.plan.ready]
        failed = "; ".join(f"{self.registry.nodes[p].name}: {why}" for p, why in self.plan.failed.items()
                           if p in self.registry.nodes)
        return f"plan {self.plan.version} waits for {', '.join(waiting)}" + (f" ({failed})" if failed else "")

    def to_json(self) -> dict[str, object]:
        return {"model": self.model, "num_layers": self.model_config.num_layers,
                "plan": self.plan.to_json() if self.plan else None, "problem": self.problem,
                "history": self.history}
