"""Routing for EcoServe (§3.4): each request to one instance (a node holding the whole model) by the overall
scheduler (`policy.ecoserve_overall.Overall`: macro-instances by weighted round-robin, then Algorithm 1 with
Algorithm 2's checks inside the macro-instance), the same objects the PaDG simulator routes with.

A plan for it (`planner/ecoserve_plan.py`) lists every instance as a replica of one node. Algorithm 2 reads each
instance's state (`InstanceState`), which the instance's node reveals to the coordinator as it happens:

- a request routed there joins its prefill phase (its prompt in `pending_prefills`);
- a request's first token (streamed to the coordinator at once) ends its prefill; when every prompt of the
  phase has its first token, the node's batcher (`policy.temporal_batching`) has no prompt left and switches to
  decoding: that instant is the instance's t_switch, and the phase's requests become its decodes;
- each later token (`progress`) is a decode's output so far, for the saved TPOT;
- free KV: the node's KV pool, as its heartbeats report it (`set_capacity`), under the high-water mark, less
  the prompts and expected outputs of the requests it holds (the charges every policy here keeps).

The state goes to the macro-instance scheduler (`MacroScheduler.update`) before each decision, so a decision
always reads every instance's latest state. A request is queued when no instance of the chosen macro-instance
has KV room for it; a node that goes down leaves its macro-instance at once.

Pure: no I/O, no clock (every call passes `now`).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from hetnode.coordinator.scheduler import Decision, NodeDown, NodeKV, PipelineHop, QueuedScheduler
from hetnode.errors import ConfigError
from hetnode.planner.ecoserve_plan import N_LOWER, N_UPPER, macro_of
from hetnode.planner.plan import PlacementPlan
from hetnode.policy.ecoserve import Decoding, InstanceState, PrefillTime, Slos
from hetnode.policy.ecoserve_overall import Overall
from hetnode.policy.macro_scheduler import MacroScheduler

SLOS = Slos(ttft_s=5.0, tpot_s=0.1)  # the simulator's default SLOs (padg_cli)


@dataclass(slots=True)
class _Held:
    prompt: int
    routed_at: float
    output: int = 0  # tokens generated so far
    first_token_at: float = -1.0


@dataclass(slots=True)
class _Instance:
    hop: PipelineHop
    switched_at: float = 0.0
    held: dict[str, _Held] = field(default_factory=dict)
    down: bool = False

    def phase_prompts(self) -> list[int]:
        return [h.prompt for h in self.held.values() if h.routed_at >= self.switched_at]


class EcoServeScheduler(QueuedScheduler):
    name: ClassVar[str] = "ecoserve"
    _unit = "instance"
    _full = "waiting: no instance of the macro-instance has KV room under its high-water mark"

    def __init__(self, plan: PlacementPlan, *, predictors: Mapping[str, PrefillTime], slos: Slos = SLOS,
                 lower: int = N_LOWER, upper: int = N_UPPER, kv_capacity: Mapping[str, int] | None = None,
                 high_water: float = 0.9, avg_output_len: float = 240.0, queue_limit: int = 1024, seed: int = 0,
                 output_ratio: float = 1.0, learn_output: bool = True) -> None:
        super().__init__(high_water=high_water, avg_output_len=avg_output_len, queue_limit=queue_limit,
                         output_ratio=output_ratio, learn_output=learn_output)
        if plan.method != "ecoserve" or not plan.replicas or any(len(r.nodes) != 1 for r in plan.replicas):
            raise ConfigError(f"plan {plan.cluster}/{plan.model} is not an EcoServe plan: it needs one-node "
                              f"instances as its replicas, not {[r.nodes for r in plan.replicas]}")
        ranges = plan.ranges()
        self._instances: dict[str, _Instance] = {}
        for r in plan.replicas:
            node = r.nodes[0]
            macro_of(r.role)
            if ranges.get(node) != (0, plan.num_layers):
                raise ConfigError(f"plan {plan.cluster}/{plan.model}: instance {node} holds {ranges.get(node)}, "
                                  f"not all {plan.num_layers} layers")
            if node not in predictors:
                raise ConfigError(f"no prefill-time predictor for the EcoServe instance {node}")
            self._instances[node] = _Instance(PipelineHop(node, 0, plan.num_layers))
        # One predictor per macro-instance scheduler: the slowest instance's, so that Algorithm 2 never counts a
        # slow node's prefills as fast (the paper's instances are alike; a testnet's may not be).
        slowest = max((predictors[n] for n in self._instances), key=lambda p: p(1024))
        self.plan = plan
        self.slos = slos
        self.overall = Overall(lower, upper, lambda: MacroScheduler(slos, slowest))
        for node in sorted(self._instances):  # the plan's order of addition: its macro-instances again
            self.overall.add(node, InstanceState(switched_at=0.0))
        self._capacity = dict(kv_capacity or {})
        self._running: dict[str, str] = {}  # request -> its instance
        self._down: set[str] = set()
        self.decisions = 0

    # -- what the executors report ------------------------------------------------------------------------------

    def prefilled(self, request_id: str, now: float) -> list[Decision]:
        """The request's first token: its prompt is prefilled; its instance switches to decoding once its whole
        prefill phase has its first tokens."""
        self._now = max(self._now, now)
        node = self._running.get(request_id)
        if node is None:
            return []
        inst = self._instances[node]
        held = inst.held[request_id]
        if held.first_token_at < 0:
            held.first_token_at, held.output = now, max(held.output, 1)
        if all(h.first_token_at >= 0 for h in inst.held.values() if h.routed_at >= inst.switched_at):
            inst.switched_at = now
        return []

    def progress(self, request_id: str, output_len: int, now: float) -> None:
        """The request has generated `output_len` tokens (its saved TPOT grows by SLO_TPOT with each)."""
        node = self._running.get(request_id)
        if node is not None:
            held = self._instances[node].held[request_id]
            held.output = max(held.output, output_len)

    def node_down(self, node: str, now: float | None = None) -> NodeDown:
        if now is not None:
            self._now = max(self._now, now)
        inst = self._instances.get(node)
        if node in self._down or inst is None:
            self._down.add(node)
            return NodeDown(node, (), ())
        self._down.add(node)
        inst.down = True
        k = self.overall.macro_of(node)
        self.overall.macros[k].remove(node)
        self.overall.mitosis.sizes[k] -= 1
        affected = tuple(inst.held)
        return NodeDown(node, affected, self._reject_unservable())

    def set_capacity(self, node: str, tokens: int, now: float | None = None) -> list[Decision]:
        if tokens < 0:
            raise ValueError(f"kv capacity of {node} must be >= 0, not {tokens}")
        if self._capacity.get(node) == tokens:
            return []
        self._now = self._now if now is None else max(self._now, now)
        self._capacity[node] = tokens
        return self._drain(self._now)

    # -- views -----------------------------------------------------------------------------------------------

    @property
    def largest_kv(self) -> float:
        up = [self._room(n) for n, i in self._instances.items() if not i.down]
        return max(up) if up else -math.inf

    @property
    def down(self) -> frozenset[str]:
        return frozenset(self._down)

    def kv_estimate(self) -> dict[str, NodeKV]:
        return {n: NodeKV(len(i.held), self._charged(i), self._capacity.get(n), self.high_water)
                for n, i in self._instances.items()}

    def pipeline_of(self, request_id: str) -> tuple[PipelineHop, ...] | None:
        node = self._running.get(request_id)
        return None if node is None else (self._instances[node].hop,)

    def macros(self) -> list[list[str]]:
        """The macro-instances' instances, as the overall scheduler groups them now."""
        return [[str(i) for i in m.ids] for m in self.overall.macros]

    def state(self, node: str, now: float) -> InstanceState:
        """Instance `node`'s state as Algorithm 2 reads it (see the module docstring)."""
        inst = self._instances[node]
        decodes = tuple(Decoding(h.output, h.first_token_at) for h in inst.held.values()
                        if h.routed_at < inst.switched_at and h.first_token_at >= 0)
        free = self.high_water * self._room(node) - self._charged(inst)
        k = self.overall.macro_of(node)
        return InstanceState(switched_at=inst.switched_at, pending_prefills=tuple(inst.phase_prompts()),
                             decodes=decodes, free_kv_tokens=int(max(0.0, min(free, 1 << 40))),
                             routed=self.overall.macros[k].counts[node])

    # -- the policy -----------------------------------------------------------------------------------------

    def _room(self, node: str) -> float:
        cap = self._capacity.get(node)
        return math.inf if cap is None else float(cap)

    def _charged(self, inst: _Instance) -> float:
        return sum(h.prompt for h in inst.held.values()) + len(inst.held) * self._output.mean

    def _assign(self, request_id: str, input_len: int, waited: float) -> Decision | None:
        now = self._now
        if not any(len(m) for m in self.overall.macros):
            return None
        k = self.overall.dispatch()
        while not len(self.overall.macros[k]):  # a macro-instance whose instances all went down
            k = self.overall.dispatch()
        macro = self.overall.macros[k]
        for node in macro.ids:
            macro.update(node, self.state(str(node), now))
        need = input_len + math.ceil(self._output.mean)
        fitting = [n for n in macro.ids if macro.views[n].current().free_kv_tokens >= need]
        if not fitting:
            return None
        chosen: Hashable = macro.route(input_len, need, now)
        # Algorithm 1 moves on by one when the previous instance fails a check; past an instance without KV
        # room it moves on again (one that fits exists), as its memory check would have sent the request on.
        for _ in range(len(macro)):
            if chosen in fitting:
                break
            chosen = macro.route(input_len, need, now)
        node = str(chosen)
        self._instances[node].held[request_id] = _Held(input_len, now)
        self._running[request_id] = node
        self.decisions += 1
        return Decision(request_id, (self._instances[node].hop,), waited_s=waited)

    def _release(self, running: str) -> None:
        inst = self._instances[running]
        for rid in [r for r in inst.held if self._running.get(r) is None]:
            del inst.held[rid]

    def _unservable(self, input_len: int) -> str:
        up = [n for n, i in self._instances.items() if not i.down]
        if not up:
            return f"every instance is down ({', '.join(sorted(self._down))})"
        need = input_len + self._output.mean
        room = max(self.high_water * self._room(n) for n in up)
        if need > room:
            return (f"the request needs about {need:.0f} tokens of KV ({input_len} prompt + {self._output.mean:.0f} "
                    f"expected output) and no instance has room for more than {room:.0f} under the high-water mark")
        return ""
