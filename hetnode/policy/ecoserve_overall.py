"""EcoServe's overall scheduler (§3.1): requests to macro-instances by capability, and mitosis scaling (§3.5).

- Dispatch: smooth weighted round-robin over the macro-instances, each weighted by its instance count (its
  capability: the instances are alike), so a macro-instance of 8 takes twice the requests of one of 4.
- Scaling: `add` and `remove` move one instance at a time as `Mitosis` (ecoserve.py, Fig. 7) sizes the
  macro-instances, and return the moves that split or merge them; a moved instance keeps serving what it holds,
  only the scheduler that routes to it changes (§3.5.2's proxy object; here the instance's id and its state).
- `ScalingTrigger`: when to add or remove: an SLO-attainment window under `target` adds one instance; `idle_windows`
  windows in a row with attainment at or above target and utilization under `low_use` remove one.
- `Scaler`: one window's scaling, as both executors (the PaDG simulator, the coordinator's EcoServe scheduler) do
  it: the trigger's verdict on the window's `attainment`, then the first spare instance added or the last one
  removed (Fig. 7's order), never below one instance.

Pure: the executor measures windows and carries out the moves.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from hetnode.policy.ecoserve import InstanceState, Mitosis
from hetnode.policy.macro_scheduler import MacroScheduler


@dataclass(frozen=True, slots=True)
class Move:
    """Instance `instance` moves from macro-instance `source` (its index before the change) to `target` (after)."""

    instance: Hashable
    source: int
    target: int


@dataclass
class Overall:
    lower: int  # N_l
    upper: int  # N_u
    make: Callable[[], MacroScheduler]  # a new, empty macro-instance scheduler
    macros: list[MacroScheduler] = field(default_factory=list)
    credit: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.mitosis = Mitosis(self.lower, self.upper, [len(m) for m in self.macros])
        self.credit = [0.0] * len(self.macros)

    def dispatch(self) -> int:
        """The macro-instance for the next request (smooth weighted round-robin by instance count)."""
        if not self.macros or not any(len(m) for m in self.macros):
            raise ValueError("no instance to dispatch to")
        total = 0
        for k, m in enumerate(self.macros):
            self.credit[k] += len(m)
            total += len(m)
        best = max(range(len(self.macros)), key=lambda k: (self.credit[k], -k))
        self.credit[best] -= total
        return best

    def route(self, prompt: int, kv_tokens: int, now: float) -> Hashable:
        return self.macros[self.dispatch()].route(prompt, kv_tokens, now)

    def macro_of(self, instance: Hashable) -> int:
        for k, m in enumerate(self.macros):
            if instance in m.views:
                return k
        raise KeyError(instance)

    def add(self, instance: Hashable, state: InstanceState) -> list[Move]:
        """One instance joins; returns the instances that moved (a split)."""
        self.mitosis.expand()
        kind, k, new = self.mitosis.last
        if kind == "first":
            self._new_macro()
        elif kind == "split":  # the full one gives N_l - 1 instances, and the new instance joins them
            self._new_macro()
            moves = []
            for moved in self.macros[k].ids[len(self.macros[k]) - (self.lower - 1):]:
                self.macros[new].add(moved, self.macros[k].remove(moved))
                moves.append(Move(moved, k, new))
            self.macros[new].add(instance, state)
            return moves
        self.macros[k].add(instance, state)
        return []

    def remove(self) -> tuple[Hashable, InstanceState, list[Move]]:
        """One instance leaves (Fig. 7's order); returns it, its last known state and any merge's moves."""
        self.mitosis.contract()
        kind, k, other = self.mitosis.last
        leaving = self.macros[k].ids[-1]
        state = self.macros[k].remove(leaving)
        if kind == "pop":
            self.macros.pop(k)
            self.credit.pop(k)
            return leaving, state, []
        if kind != "merge":
            return leaving, state, []
        # Both go, and one macro-instance holding their instances goes last (as Mitosis appends it).
        merged = self.make()
        moves = []
        for source in (k, other):
            for moved in list(self.macros[source].ids):
                merged.add(moved, self.macros[source].remove(moved))
                moves.append((moved, source))
        for source in sorted((k, other), reverse=True):
            self.macros.pop(source)
            self.credit.pop(source)
        self.macros.append(merged)
        self.credit.append(0.0)
        target = len(self.macros) - 1
        return leaving, state, [Move(m, source, target) for m, source in moves]

    def drop(self, instance: Hashable) -> None:
        """An instance that went down leaves its macro-instance at once (not Fig. 7's order: it is gone); a
        macro-instance left empty goes too."""
        k = self.macro_of(instance)
        self.macros[k].remove(instance)
        self.mitosis.sizes[k] -= 1
        if not self.mitosis.sizes[k]:
            self.macros.pop(k)
            self.credit.pop(k)
            self.mitosis.sizes.pop(k)

    def _new_macro(self) -> None:
        self.macros.append(self.make())
        self.credit.append(0.0)

    @property
    def sizes(self) -> list[int]:
        return [len(m) for m in self.macros]


@dataclass
class ScalingTrigger:
    """Add on an SLO miss, remove after sustained under-use; `decide` once per measurement window."""

    target: float = 0.9  # SLO attainment a window must reach
    low_use: float = 0.5  # utilization under which a window counts as under-used
    idle_windows: int = 4  # under-used windows in a row before removing
    quiet: int = 0

    def decide(self, attainment: float, utilization: float) -> int:
        """+1: add an instance, -1: remove one, 0: keep."""
        if attainment < self.target:
            self.quiet = 0
            return 1
        self.quiet = self.quiet + 1 if utilization < self.low_use else 0
        if self.quiet >= self.idle_windows:
            self.quiet = 0
            return -1
        return 0


def attainment(met: Sequence[bool], late: int) -> float:
    """A window's SLO attainment: of the requests that finished in it (`met`: each one's verdict) and those whose
    TTFT SLO ran out in it before their decode phase began (`late`: already missed), the share that met both
    SLOs; 1.0 for a window with nothing to judge."""
    judged = len(met) + late
    return sum(met) / judged if judged else 1.0


@dataclass(frozen=True, slots=True)
class Scaling:
    """One window's change: `instance` added or removed, on the window's attainment and utilization, leaving
    macro-instances of `sizes`, with the instances a split or merge moved."""

    at: float
    action: str  # "add" or "remove"
    instance: Hashable
    attainment: float
    utilization: float
    sizes: tuple[int, ...]
    moves: tuple[Move, ...]


@dataclass
class Scaler:
    overall: Overall
    trigger: ScalingTrigger
    order: list[Hashable]  # every instance that may serve, in the order spare ones are added

    def spare(self) -> list[Hashable]:
        """The instances in no macro-instance, in `order`."""
        serving = {i for m in self.overall.macros for i in m.ids}
        return [i for i in self.order if i not in serving]

    def window(self, now: float, attained: float, utilization: float,
               state: Callable[[Hashable], InstanceState]) -> Scaling | None:
        """The trigger's verdict on a window, carried out on the overall scheduler; `state` is a spare instance's
        state as it joins. None when nothing changes (no verdict, no spare to add, or one instance left)."""
        decision = self.trigger.decide(attained, utilization)
        if decision > 0:
            spare = self.spare()
            if not spare:
                return None
            instance, moves = spare[0], self.overall.add(spare[0], state(spare[0]))
        elif decision < 0 and sum(self.overall.sizes) > 1:
            instance, _, moves = self.overall.remove()
        else:
            return None
        return Scaling(now, "add" if decision > 0 else "remove", instance, attained, utilization,
                       tuple(self.overall.sizes), tuple(moves))
