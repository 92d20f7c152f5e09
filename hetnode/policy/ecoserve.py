"""EcoServe's macro-instance scheduling (§3.4, Algorithms 1 and 2) and mitosis scaling (§3.5).

Partially disaggregated serving keeps both phases on every instance but separates them in time: an instance
decodes, and switches to prefills when the macro-instance scheduler sends it new requests; the decodes it then
pauses have "saved TPOT" (they ran faster than the TPOT SLO) to spend. The macro-instance scheduler staggers the
instances (rolling activation) with Algorithm 1: a request goes to the instance the previous request went to
while Algorithm 2's three checks hold there, else to the next instance in the cycle:

1. TTFT: the predicted prefill times of the requests routed to the instance since Algorithm 1 came to it (its
   t_switch: the macro-instance scheduler switched it to prefills), with this one, add up to no more than the
   TTFT SLO (every one of them, a request that already finished too: the check bounds the instance's prefill
   phase, its share of the rolling activation);
2. TPOT: that total is no more than the mean saved TPOT of the decodes it runs (each decode's L x SLO_TPOT less
   the time since its first token, L its output so far);
3. memory: the request's KV fits what the instance has free.

Mitosis (§3.5.1) grows and shrinks the macro-instances one instance at a time between N_l and N_u instances:
instances are added to the last macro-instance; one that would pass N_u splits off a new macro-instance of N_l;
instances are removed from the smallest macro-instance down to N_l, then from a full one, and two
macro-instances whose sizes add up to N_u merge once one more instance is removed.

Algorithm 2 reads t_switch as "the phase switching timestamp" without saying whose. Read as the instance's own
switch from prefill back to decode, every prefill step that runs between two decode steps ends a phase, the sum
of check 1 restarts with each, and at light load one instance takes every arrival (a prefill every few decode
steps, for ever, while the mean saved TPOT of its oldest decodes stays high) and its newest decodes miss the TPOT
SLO: no rolling activation at all (docs/reproducing-ecoserve.md measures it). Read as the macro-instance
scheduler's switch, an instance's phase is the burst Algorithm 1 sends it, and the bursts roll over the
instances as §3.2.2 and Fig. 5 describe; the TPOT check then counts the burst's own decodes too (they pay for
the burst's later prefills), not only those that came before it. The macro-instance scheduler keeps the bursts
(`macro_scheduler.MacroScheduler`); instances report their decodes and free KV.

Pure: instances report their state as records; every call passes `now`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Decoding:
    """A request an instance decodes: its output so far and when its first token came."""

    output_len: int
    first_token_at: float


@dataclass(frozen=True, slots=True)
class InstanceState:
    """What an instance reports to its macro-instance scheduler."""

    decodes: tuple[Decoding, ...] = ()  # requests it decodes (it has their first token)
    free_kv_tokens: int = 0
    routed: int = 0  # requests routed to it so far, as it counts them (a scheduler adds those sent since)


@dataclass(frozen=True, slots=True)
class Slos:
    ttft_s: float
    tpot_s: float

    def met(self, *, arrival: float, first_token: float, decode_start: float, last_token: float,
            output: int) -> bool:
        """Whether a finished request of `output` tokens met both, as EcoServe judges (§3.3): its TTFT runs to the
        start of its decode phase (to its first token when it has none), its TPOT over the decode phase. A time
        not known (nan) is a miss. The simulator and the coordinator's scaling judge with this."""
        if output > 1:
            ttft, tpot = decode_start - arrival, (last_token - decode_start) / (output - 1)
        else:
            ttft, tpot = first_token - arrival, 0.0
        return ttft <= self.ttft_s and tpot <= self.tpot_s


PrefillTime = Callable[[int], float]  # seconds to prefill a prompt of n tokens (profiled)


def check(instance: InstanceState, burst: Sequence[int], prompt: int, kv_tokens: int, now: float, slos: Slos,
          prefill: PrefillTime) -> str:
    """Algorithm 2 for a request of `prompt` tokens on an instance whose burst so far (the prompts routed to it
    since its t_switch) is `burst`: '' when it may take the request, else the constraint it would break."""
    total = sum(prefill(n) for n in burst) + prefill(prompt)
    if total > slos.ttft_s:
        return f"ttft: {total:.3f} s of pending prefills > {slos.ttft_s:g} s"
    if instance.decodes:
        saved = [d.output_len * slos.tpot_s - (now - d.first_token_at) for d in instance.decodes]
        mean = sum(saved) / len(saved)
        if mean < total:
            return f"tpot: mean saved {mean:.3f} s < {total:.3f} s of prefills"
    if kv_tokens > instance.free_kv_tokens:
        return f"memory: {kv_tokens} tokens of KV > {instance.free_kv_tokens} free"
    return ""


@dataclass
class MacroInstance:
    """Algorithm 1 over one macro-instance's instances (by index)."""

    instances: int
    previous: int = 0  # the instance the last request went to
    moved: bool = False  # whether the last request went on to the next instance (opening its burst)

    def route(self, states: Sequence[InstanceState], bursts: Sequence[Sequence[int]], prompt: int, kv_tokens: int,
              now: float, slos: Slos, prefill: PrefillTime) -> int:
        """The instance for the request: the previous one if it passes every check, else the next one."""
        if len(states) != self.instances or len(bursts) != self.instances or not states:
            raise ValueError(f"expected the states and bursts of {self.instances} instances, got {len(states)} and "
                             f"{len(bursts)}")
        self.moved = bool(check(states[self.previous], bursts[self.previous], prompt, kv_tokens, now, slos, prefill))
        if self.moved:
            self.previous = (self.previous + 1) % self.instances
        return self.previous


@dataclass
class Mitosis:
    """The macro-instances' sizes, grown and shrunk one instance at a time (§3.5.1, Fig. 7)."""

    lower: int  # N_l
    upper: int  # N_u
    sizes: list[int] = field(default_factory=list)
    # The last change, for an executor that moves real instances: (kind, macro-instance, other), kind one of
    # "first", "add", "split" (other: the new one), "remove", "pop", "merge" (the removal's, then the other).
    last: tuple[str, int, int] = ("", -1, -1)

    def __post_init__(self) -> None:
        if not 1 <= self.lower < self.upper:
            raise ValueError(f"need 1 <= N_l < N_u, not {self.lower} and {self.upper}")
        if any(s < 1 or s > self.upper for s in self.sizes):
            raise ValueError(f"a macro-instance has 1 to N_u = {self.upper} instances, not {self.sizes}")

    @property
    def total(self) -> int:
        return sum(self.sizes)

    def expand(self) -> str:
        """Add one instance; returns what happened."""
        if not self.sizes:
            self.sizes.append(1)
            self.last = ("first", 0, -1)
            return "a first macro-instance"
        full = [i for i, s in enumerate(self.sizes) if s < self.upper]
        if not full:  # every macro-instance is at N_u: the last one splits N_l off (steps 1-2)
            self.sizes[-1] -= self.lower - 1
            self.sizes.append(self.lower)
            self.last = ("split", len(self.sizes) - 2, len(self.sizes) - 1)
            return f"macro-instance {len(self.sizes) - 2} split, {self.lower} instances into a new one"
        # Fill the fullest that is not full first (step 3), then the new one (step 4).
        i = max(full, key=lambda k: (self.sizes[k], -k))
        self.sizes[i] += 1
        self.last = ("add", i, -1)
        return f"an instance added to macro-instance {i}"

    def contract(self) -> str:
        """Remove one instance; returns what happened."""
        if not self.sizes:
            raise ValueError("no instance to remove")
        small = min(range(len(self.sizes)), key=lambda k: (self.sizes[k], -k))
        if self.sizes[small] > self.lower or len(self.sizes) == 1:  # step 5: the smallest down to N_l
            self.sizes[small] -= 1
            self.last = ("remove", small, -1)
            if self.sizes[small] == 0:
                self.sizes.pop(small)
                self.last = ("pop", small, -1)
            return f"an instance removed from macro-instance {small}"
        # Step 6: from a full one; steps 7-8: two that add up to N_u merge after one more removal.
        big = max((k for k in range(len(self.sizes)) if k != small), key=lambda k: (self.sizes[k], k))
        self.sizes[big] -= 1
        self.last = ("remove", big, -1)
        if self.sizes[big] + self.sizes[small] < self.upper:
            merged = self.sizes[big] + self.sizes[small]
            for k in sorted((big, small), reverse=True):
                self.sizes.pop(k)
            self.sizes.append(merged)
            self.last = ("merge", big, small)
            return f"macro-instances {min(big, small)} and {max(big, small)} merged into one of {merged}"
        return f"an instance removed from macro-instance {big}"
