"""Routing for EcoServe (§3.4): each request to one instance (a node holding the whole model, or a pipeline of
nodes that together hold it, named by its first node) by the overall scheduler (`policy.ecoserve_overall.Overall`:
macro-instances by weighted round-robin, then Algorithm 1 with Algorithm 2's checks inside the macro-instance),
the same objects the PaDG simulator routes with.

A plan for it (`planner/ecoserve_plan.py`) lists every instance as a replica. Algorithm 2 reads each instance's
state (`InstanceState`), which the instance's nodes reveal to the coordinator as it happens:

- a request routed there joins the instance's burst (the macro-instance scheduler's own record, since Algorithm
  1 last moved on to it: its t_switch, `policy.ecoserve`);
- a request's first token (streamed to the coordinator at once) ends its prefill and makes it one of the
  instance's decodes; when every prompt routed there has its first token, the node's batcher
  (`policy.temporal_batching`) has no prompt left and switches to decoding: EcoServe's TTFT of those requests
  ends there (§3.3);
- each later token (`progress`) is a decode's output so far, for the saved TPOT;
- free KV: the node's KV pool, as its heartbeats report it (`set_capacity`), under the high-water mark, less
  the prompts and expected outputs of the requests it holds (the charges every policy here keeps).

The state goes to the macro-instance scheduler (`MacroScheduler.update`) before each decision, so a decision
always reads every instance's latest state. A request is queued when no instance of the chosen macro-instance
has KV room for it; a node that goes down leaves its macro-instance at once.

Mitosis scaling (§3.5), when given a `ScalingTrigger`: only the `active` instances serve at first, the rest are
spare (loaded, routed nothing). The executor calls `scale` once per window; the window's SLO attainment (each
finished request judged as the simulator judges it: EcoServe's TTFT to its decode phase, and its TPOT; a request
whose TTFT SLO ran out before its decode phase counts as a miss) and the active instances' utilization (the share
of the window each held a request) go to the same `Scaler` the simulator scales with: a spare instance is added,
or the last one removed. A removed instance finishes what it holds, routed nothing new. A split or merge moves
instances between macro-instance schedulers with their state; their running requests never notice (nothing is
sent to the node), and routing pauses only for the call itself (the executor times it).

Pure: no I/O, no clock (every call passes `now`).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from hetnode.coordinator.scheduler import Decision, NamedCapacityScheduler, NodeDown, NodeKV, PipelineHop
from hetnode.errors import ConfigError
from hetnode.planner.ecoserve_plan import N_LOWER, N_UPPER, macro_of
from hetnode.planner.plan import PlacementPlan
from hetnode.policy.ecoserve import Decoding, InstanceState, PrefillTime, Slos
from hetnode.policy.ecoserve_overall import Overall, Scaler, Scaling, ScalingTrigger, attainment
from hetnode.policy.macro_scheduler import MacroScheduler

SLOS = Slos(ttft_s=5.0, tpot_s=0.1)  # the simulator's default SLOs (padg_cli)


@dataclass(slots=True)
class _Held:
    prompt: int
    routed_at: float
    arrived_at: float
    output: int = 0  # tokens generated so far
    first_token_at: float = -1.0
    decode_at: float = -1.0  # its instance switched to decoding with it (EcoServe's TTFT ends here)

    def meets(self, slos: Slos, now: float) -> bool:
        """Finished now: whether it met both SLOs (`Slos.met`, as the simulator judges); its decode phase began
        at its first token if its phase's switch was never seen."""
        first = self.first_token_at if self.first_token_at >= 0 else math.nan
        return slos.met(arrival=self.arrived_at, first_token=first,
                        decode_start=self.decode_at if self.decode_at >= 0 else first, last_token=now,
                        output=self.output)


@dataclass(slots=True)
class _Instance:
    hops: tuple[PipelineHop, ...]  # one node holding the model, or a pipeline of nodes
    switched_at: float = 0.0  # when its last prefill phase ended (its requests' decode phase began)
    held: dict[str, _Held] = field(default_factory=dict)
    down: bool = False
    busy_s: float = 0.0  # time it held a request, up to busy_at
    busy_at: float = 0.0
    busy_mark: float = 0.0  # busy_s as the last window ended


class EcoServeScheduler(NamedCapacityScheduler):
    name: ClassVar[str] = "ecoserve"
    _unit = "instance"
    _full = "waiting: no instance of the macro-instance has KV room under its high-water mark"

    def __init__(self, plan: PlacementPlan, *, predictors: Mapping[str, PrefillTime], slos: Slos = SLOS,
                 lower: int = N_LOWER, upper: int = N_UPPER, kv_capacity: Mapping[str, int] | None = None,
                 high_water: float = 0.9, avg_output_len: float = 240.0, queue_limit: int = 1024, seed: int = 0,
                 output_ratio: float = 1.0, learn_output: bool = True, trigger: ScalingTrigger | None = None,
                 active: Collection[str] | None = None, since: float = 0.0) -> None:
        super().__init__(high_water=high_water, avg_output_len=avg_output_len, queue_limit=queue_limit,
                         output_ratio=output_ratio, learn_output=learn_output)
        if plan.method != "ecoserve" or not plan.replicas:
            raise ConfigError(f"plan {plan.cluster}/{plan.model} is not an EcoServe plan: it needs instances as its "
                              f"replicas")
        ranges = plan.ranges()
        self._instances: dict[str, _Instance] = {}  # by the instance's first node
        self._instance_of: dict[str, str] = {}  # every node of an instance -> the instance
        for r in plan.replicas:
            macro_of(r.role)
            layer, hops = 0, []
            for node in r.nodes:
                if ranges.get(node, (-1, -1))[0] != layer:
                    raise ConfigError(f"plan {plan.cluster}/{plan.model}: instance {' -> '.join(r.nodes)} does not "
                                      f"run every layer once, in order")
                hops.append(PipelineHop(node, *ranges[node]))
                layer = ranges[node][1]
                self._instance_of[node] = r.nodes[0]
            if layer != plan.num_layers:
                raise ConfigError(f"plan {plan.cluster}/{plan.model}: instance {' -> '.join(r.nodes)} ends at layer "
                                  f"{layer}, not {plan.num_layers}")
            if r.nodes[0] not in predictors:
                raise ConfigError(f"no prefill-time predictor for the EcoServe instance {r.nodes[0]}")
            self._instances[r.nodes[0]] = _Instance(tuple(hops))
        # One predictor per macro-instance scheduler: the slowest instance's, so that Algorithm 2 never counts a
        # slow node's prefills as fast (the paper's instances are alike; a testnet's may not be).
        slowest = max((predictors[n] for n in self._instances), key=lambda p: p(1024))
        self.plan = plan
        self.slos = slos
        self.overall = Overall(lower, upper, lambda: MacroScheduler(slos, slowest))
        serving = sorted(self._instances) if active is None else sorted(set(active) & set(self._instances))
        if not serving:
            raise ConfigError(f"none of the active instances {sorted(active or ())} is an instance of the plan "
                              f"({', '.join(sorted(self._instances))})")
        for node in serving:  # the plan's order of addition: its macro-instances again
            self.overall.add(node, InstanceState())
        # The spare instances join in name order; without a trigger there are none (every instance serves).
        self.scaler = None if trigger is None else Scaler(self.overall, trigger, list(sorted(self._instances)))
        self.scalings: list[Scaling] = []  # the latest changes, oldest first
        self._met: list[bool] = []  # verdicts of the requests finished since the last window
        self._window_at = since  # the first window starts with the scheduler
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
        phase = [h for h in inst.held.values() if h.routed_at >= inst.switched_at]
        if all(h.first_token_at >= 0 for h in phase):
            inst.switched_at = now
            for h in phase:
                h.decode_at = now
        return []

    def progress(self, request_id: str, output_len: int, now: float) -> None:
        """The request has generated `output_len` tokens (its saved TPOT grows by SLO_TPOT with each)."""
        node = self._running.get(request_id)
        if node is not None:
            held = self._instances[node].held[request_id]
            held.output = max(held.output, output_len)

    def finish(self, request_id: str, output_len: int, now: float) -> list[Decision]:
        node = self._running.get(request_id)
        if node is not None:
            held = self._instances[node].held[request_id]
            held.output = max(held.output, output_len)
            self._met.append(held.meets(self.slos, now))
        return super().finish(request_id, output_len, now)

    def node_down(self, node: str, now: float | None = None) -> NodeDown:
        """A node went down: its instance (the node, or the pipeline it is a stage of) with it."""
        if now is not None:
            self._now = max(self._now, now)
        name = self._instance_of.get(node, node)
        inst = self._instances.get(name)
        if node in self._down or inst is None or inst.down:
            self._down.add(node)
            return NodeDown(node, (), ())
        self._down.add(node)
        inst.down = True
        node = name
        if node in self.active:
            self.overall.drop(node)
        if self.scaler is not None:
            self.scaler.order.remove(node)
            spare = self.scaler.spare()
            if not self.overall.macros and spare:  # the last serving instance went: a spare takes over at once
                moves = self.overall.add(spare[0], self.state(str(spare[0]), self._now))
                self.scalings.append(Scaling(self._now, "add", spare[0], math.nan, math.nan,
                                             tuple(self.overall.sizes), tuple(moves)))
        affected = tuple(inst.held)
        return NodeDown(node, affected, self._reject_unservable())

    def scale(self, now: float) -> tuple[Scaling | None, list[Decision]]:
        """The window since the last call ends: mitosis's change if the trigger calls for one (see the module
        docstring), and the queued requests an added instance let start."""
        if self.scaler is None:
            raise ValueError("this EcoServe scheduler scales nothing: it was made without a trigger")
        self._now = max(self._now, now)
        start, self._window_at = self._window_at, now
        ttft = self.slos.ttft_s
        late = sum(1 for i in self._instances.values() for h in i.held.values()
                   if h.decode_at < 0 and start < h.arrived_at + ttft <= now)
        late += sum(1 for w in self._queue.values() if start < w.since + ttft <= now)
        attained = attainment(self._met, late)
        self._met = []
        active = self.active
        use = []
        for node, inst in self._instances.items():
            busy = self._busy(inst, now)
            if node in active and now > start:
                use.append(min(1.0, (busy - inst.busy_mark) / (now - start)))
            inst.busy_mark = busy
        change = self.scaler.window(now, attained, sum(use) / len(use) if use else 0.0,
                                    lambda node: self.state(str(node), now))
        if change is None:
            return None, []
        self.scalings.append(change)
        del self.scalings[:-100]
        return change, self._drain(now) if change.action == "add" else []

    # -- views -----------------------------------------------------------------------------------------------

    @property
    def largest_kv(self) -> float:
        up = [self._room(n) for n, i in self._instances.items() if not i.down]
        return max(up) if up else -math.inf

    @property
    def down(self) -> frozenset[str]:
        return frozenset(self._down)

    def kv_estimate(self) -> dict[str, NodeKV]:
        return {h.node: NodeKV(len(i.held), self._charged(i), self._capacity.get(h.node), self.high_water)
                for i in self._instances.values() for h in i.hops}

    def pipeline_of(self, request_id: str) -> tuple[PipelineHop, ...] | None:
        node = self._running.get(request_id)
        return None if node is None else self._instances[node].hops

    @property
    def active(self) -> frozenset[str]:
        """The instances in a macro-instance: routed to."""
        return frozenset(str(i) for m in self.overall.macros for i in m.ids)

    def spare(self) -> list[str]:
        """Up instances routed nothing, in the order mitosis would add them."""
        return [str(i) for i in self.scaler.spare()] if self.scaler is not None else []

    def macros(self) -> list[list[str]]:
        """The macro-instances' instances, as the overall scheduler groups them now."""
        return [[str(i) for i in m.ids] for m in self.overall.macros]

    def state(self, node: str, now: float) -> InstanceState:
        """Instance `node`'s state as Algorithm 2 reads it (see the module docstring)."""
        inst = self._instances[node]
        decodes = tuple(Decoding(h.output, h.first_token_at) for h in inst.held.values() if h.first_token_at >= 0)
        free = self.high_water * self._room(node) - self._charged(inst)
        try:
            routed = self.overall.macros[self.overall.macro_of(node)].counts[node]
        except KeyError:  # a spare instance
            routed = 0
        return InstanceState(decodes=decodes, free_kv_tokens=int(max(0.0, min(free, 1 << 40))), routed=routed)

    # -- the policy -----------------------------------------------------------------------------------------

    def _room(self, instance: str) -> float:
        """KV tokens the instance holds: its tightest node's (every node keeps the KV of its layers for every
        request)."""
        caps = [self._capacity.get(h.node) for h in self._instances[instance].hops]
        known = [c for c in caps if c is not None]
        return float(min(known)) if known else math.inf

    def _busy(self, inst: _Instance, now: float) -> float:
        """Its time holding a request, up to `now`."""
        return inst.busy_s + (now - inst.busy_at if inst.held else 0.0)

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
        inst = self._instances[node]
        inst.busy_s, inst.busy_at = self._busy(inst, now), now
        inst.held[request_id] = _Held(input_len, now, now - waited)
        self._running[request_id] = node
        self.decisions += 1
        return Decision(request_id, self._instances[node].hops, waited_s=waited)

    def _release(self, running: str) -> None:
        inst = self._instances[running]
        inst.busy_s, inst.busy_at = self._busy(inst, self._now), self._now
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
