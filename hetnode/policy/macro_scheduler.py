"""EcoServe's macro-instance scheduler (§3.4): Algorithm 1 over the instances' latest reported states.

Instances report their state (`InstanceState`: their decodes and free KV) when it changes in a way Algorithm 2
reads: a switch of phase, a request finished, a preemption, and periodically while decoding (its progress);
never per iteration. Between reports the scheduler knows what it routed itself: each report carries how many
requests the instance had been sent (`routed`), and the requests routed after that are taken off its free KV, so
two requests routed in one instant both count. The bursts are the scheduler's own record: the prompts it routed
to each instance since Algorithm 1 last moved on to it (that instance's t_switch, `policy.ecoserve`), kept
whether or not their requests have finished.

Instances may join and leave (mitosis scaling, an instance added under load) without the others noticing:
routing continues from the same cycle position.

Pure: every call passes `now`; ids are the executor's (a simulated instance's index, a node's id).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field, replace

from hetnode.policy.ecoserve import InstanceState, MacroInstance, PrefillTime, Slos


@dataclass
class _View:
    state: InstanceState
    sent: list[tuple[int, int]] = field(default_factory=list)  # (routed count after it, prompt) since the report
    burst: list[int] = field(default_factory=list)  # prompts routed since the cycle last moved on to it

    def current(self) -> InstanceState:
        extra = sum(p for k, p in self.sent if k > self.state.routed)
        if not extra:
            return self.state
        return replace(self.state, free_kv_tokens=max(0, self.state.free_kv_tokens - extra))


@dataclass
class MacroScheduler:
    slos: Slos
    prefill: PrefillTime
    ids: list[Hashable] = field(default_factory=list)
    cycle: MacroInstance = field(default_factory=lambda: MacroInstance(0))
    views: dict[Hashable, _View] = field(default_factory=dict)
    counts: dict[Hashable, int] = field(default_factory=dict)  # requests routed to each instance

    def add(self, instance: Hashable, state: InstanceState) -> None:
        """An instance joins (at the end of the cycle) with its current state."""
        if instance in self.views:
            raise ValueError(f"instance {instance!r} is already in this macro-instance")
        self.ids.append(instance)
        self.views[instance] = _View(state)
        self.counts[instance] = state.routed
        self.cycle.instances = len(self.ids)

    def remove(self, instance: Hashable) -> InstanceState:
        """An instance leaves (it keeps serving what it holds); returns its last known state."""
        k = self.ids.index(instance)
        self.ids.pop(k)
        self.counts.pop(instance)
        view = self.views.pop(instance)
        self.cycle.instances = len(self.ids)
        if k < self.cycle.previous or self.cycle.previous >= len(self.ids):
            self.cycle.previous = max(0, self.cycle.previous - 1) if self.ids else 0
        return view.current()

    def update(self, instance: Hashable, state: InstanceState) -> None:
        """An instance's report."""
        view = self.views.get(instance)
        if view is None:
            return  # it left between sending the report and its arrival
        view.state = state
        view.sent = [(k, p) for k, p in view.sent if k > state.routed]

    def states(self) -> list[InstanceState]:
        return [self.views[i].current() for i in self.ids]

    def route(self, prompt: int, kv_tokens: int, now: float) -> Hashable:
        """Algorithm 1: the instance for a request of `prompt` tokens needing `kv_tokens` of KV."""
        if not self.ids:
            raise ValueError("the macro-instance has no instance")
        bursts = [self.views[i].burst for i in self.ids]  # not copied: Algorithm 1 only reads them
        k = self.cycle.route(self.states(), bursts, prompt, kv_tokens, now, self.slos, self.prefill)
        instance = self.ids[k]
        view = self.views[instance]
        self.counts[instance] += 1
        view.sent.append((self.counts[instance], prompt))
        if self.cycle.moved:
            view.burst.clear()
        view.burst.append(prompt)
        return instance

    def bursts(self) -> list[tuple[int, ...]]:
        """Each instance's burst: the prompts routed to it since its t_switch."""
        return [tuple(self.views[i].burst) for i in self.ids]

    def __len__(self) -> int:
        return len(self.ids)
