"""Splitwise's machine-level scheduler (§IV-B): which queued items run in a machine's next step.

A machine runs the shared batch policy (`BatchPolicy`: the token budget, one item per session, KV admission
and growth against the node's `KVLedger`, preemption when admitted sessions deadlock) over a queue this policy
orders and trims first, by what the queue holds (a machine's pool is the cluster-level scheduler's business;
what it has been sent is what the machine sees, and a machine lent to the mixed pool holds both kinds):

- Prompts only (a prompt machine): first come, first served, at most `prompt_tokens` prompt tokens a step
  (Splitwise's 2,048: past it a prompt batch's throughput no longer grows, their Fig. 6a). Prompts are never
  cut to fill a step: the first prompt that does not fit ends the step, and the later ones wait behind it,
  however small. A prompt larger than the cap runs alone (split only where it exceeds the engine's own budget).
- Decodes only (a token machine): every decode, first come first served, as far as the token budget goes:
  throughput keeps growing with the batch until memory runs out (Fig. 6b). A session new to this machine
  (its KV not reserved here by a hand-off) is admitted only while the pool stays under `high_water` of its
  blocks, so a near-full machine queues new work rather than preempting what it runs.
- Both (a mixed machine): prompts first, within the same cap, then decodes in the budget left. When the head
  prompt's KV does not fit, the machine preempts decoding sessions, the youngest first (the least work lost),
  but only when that frees enough for it, and never one already preempted `max_preemptions` times. A decode
  passed over by a step ages by one; once it has waited `max_wait_steps` steps it goes ahead of the prompts.
  Together the two bounds mean a token never starves.

Preempted sessions come back in `Step.preempted` and their queued items in `Step.dropped`, as the shared
policy's own preemptions do, so both executors fail them with `PREEMPTED` and the coordinator moves them.
State across steps (ages, preemption counts) lives in this object, one per machine; no clock, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from hetnode.policy.batching import BatchConfig, BatchPolicy, Pending, Step
from hetnode.policy.kv_ledger import KVLedger

T = TypeVar("T", bound=Pending)

PROMPT_TOKENS = 2048  # Splitwise §IV-B: prompt tokens batched together on Llama-2 70B / DGX
_PREEMPTION_MEMORY = 65536  # sessions whose preemption count is remembered (a moved session may come back)


@dataclass(frozen=True, slots=True)
class MachineConfig:
    """Knobs of Splitwise's machine-level scheduler; the runtime and the simulator take the same defaults."""

    prompt_tokens: int = PROMPT_TOKENS  # most prompt tokens one step batches, >= 1
    high_water: float = 0.95  # a new session is admitted while the KV pool stays under this share, in (0, 1]
    max_wait_steps: int = 8  # steps a decode may be passed over before it goes ahead of prompts, >= 1
    max_preemptions: int = 1  # times one session may be preempted for a prompt on a mixed machine, >= 0

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, not {self.prompt_tokens}")
        if not 0 < self.high_water <= 1:
            raise ValueError(f"high_water must be in (0, 1], not {self.high_water}")
        if self.max_wait_steps < 1 or self.max_preemptions < 0:
            raise ValueError(f"max_wait_steps must be >= 1 ({self.max_wait_steps}) and max_preemptions >= 0 "
                             f"({self.max_preemptions})")


class SplitwiseBatchPolicy(BatchPolicy):
    """§IV-B over the shared batch policy; see the module docstring."""

    __slots__ = ("age", "machine", "mode", "preemptions")

    def __init__(self, ledger: KVLedger, config: BatchConfig | None = None,
                 machine: MachineConfig | None = None) -> None:
        super().__init__(ledger, config)
        self.machine = machine or MachineConfig()
        self.age: dict[Hashable, int] = {}  # session -> steps its queued decode has been passed over
        self.preemptions: OrderedDict[Hashable, int] = OrderedDict()
        self.mode = ""  # what the last step saw: "prompt", "token" or "mixed" (statistics and tests)

    def form(self, queue: Sequence[T]) -> Step[T]:
        heads: list[T] = []  # each session's first queued item: the only one that may run this step
        seen: set[Hashable] = set()
        for it in queue:
            if it.session not in seen:
                seen.add(it.session)
                heads.append(it)
        prompts = [it for it in heads if it.start < it.prefill_end]
        decodes = [it for it in heads if it.start >= it.prefill_end]
        self.age = {s: a for s, a in self.age.items() if s in seen}
        self.mode = "mixed" if prompts and decodes else "prompt" if prompts else "token"
        victims: list[Hashable] = []
        chosen_prompts = self._prompts(prompts)
        if self.mode == "mixed" and chosen_prompts:
            victims = self._make_room(chosen_prompts[0], decodes)
            decodes = [it for it in decodes if it.session not in victims]
        # Decodes held back by the high-water mark wait for memory, not for prompts: they do not age.
        admissible = self._admissible(decodes)
        wait = self.machine.max_wait_steps
        aged = [it for it in admissible if self.age.get(it.session, 0) >= wait]
        rest = [it for it in admissible if self.age.get(it.session, 0) < wait]
        step = super().form([*aged, *chosen_prompts, *rest])
        return self._whole(step, queue, victims, admissible)

    def _prompts(self, prompts: list[T]) -> list[T]:
        """First come, first served under the cap; the first that does not fit stops the rest."""
        cap = self.machine.prompt_tokens
        chosen: list[T] = []
        tokens = 0
        for it in prompts:
            if chosen and tokens + it.num_tokens > cap:
                break
            chosen.append(it)
            tokens += it.num_tokens
        return chosen

    def _admissible(self, decodes: list[T]) -> list[T]:
        """Decodes of held sessions, and new ones in order while the pool stays under the high-water mark."""
        ledger = self.ledger
        mark = self.machine.high_water * ledger.capacity
        used = ledger.used
        out: list[T] = []
        admitting = True
        for it in decodes:
            if it.session in ledger:
                out.append(it)
                continue
            need = ledger.blocks_for(max(it.prefill_end, it.start + it.num_tokens))
            if admitting and used + need <= mark:
                used += need
                out.append(it)
            else:
                admitting = False  # first come, first admitted
        return out

    def _make_room(self, head: T, decodes: list[T]) -> list[Hashable]:
        """Preempt decoding sessions, youngest first, until the head prompt's KV fits; none unless that suffices."""
        ledger = self.ledger
        if head.session in ledger:
            return []
        need = ledger.blocks_for(max(head.prefill_end, head.start + head.num_tokens))
        if need <= ledger.free or need > ledger.capacity:
            return []
        limit = self.machine.max_preemptions
        open_ = [it.session for it in decodes
                 if it.session in ledger and self.preemptions.get(it.session, 0) < limit]
        free = ledger.free
        victims: list[Hashable] = []
        while free < need and open_:
            victim = ledger.youngest(open_)
            open_.remove(victim)
            victims.append(victim)
            free += ledger.held(victim)
        if free < need:
            return []
        for victim in victims:
            ledger.release(victim)
            self.preemptions[victim] = self.preemptions.get(victim, 0) + 1
            self.preemptions.move_to_end(victim)
        while len(self.preemptions) > _PREEMPTION_MEMORY:
            self.preemptions.popitem(last=False)
        return victims

    def _whole(self, step: Step[T], queue: Sequence[T], victims: list[Hashable], decodes: list[T]) -> Step[T]:
        """The step over the whole queue: waiting back in arrival order, the preempted sessions' items dropped,
        and the ages of the decodes this step passed over."""
        preempted = set(victims) | set(step.preempted)
        ran = {id(it) for it in step.batch if it is not step.split}
        gone = {id(it) for it in step.refused}
        refused_sessions = {it.session for it in step.refused}
        waiting: list[T] = []
        dropped: list[T] = []
        refused = list(step.refused)
        for it in queue:
            if id(it) in ran or id(it) in gone:
                continue
            if it.session in preempted:
                dropped.append(it)
            elif it.session in refused_sessions:
                refused.append(it)
            else:
                waiting.append(it)
        running = {it.session for it in step.batch}
        for it in decodes:
            s = it.session
            self.age[s] = 0 if s in running else self.age.get(s, 0) + 1
        out = Step(step.batch, waiting, step.tokens, step.split, step.split_tokens, step.blocked, refused)
        out.preempted = [*victims, *step.preempted]
        out.dropped = dropped
        return out


def splitwise_policy(machine: MachineConfig | None = None) -> Callable[[KVLedger, BatchConfig], BatchPolicy]:
    """The factory `BatchLoop` and `SimNode` take (`policy=`), with these machine-level settings."""

    def make(ledger: KVLedger, config: BatchConfig) -> BatchPolicy:
        return SplitwiseBatchPolicy(ledger, config, machine)

    return make


# The runtime's `--batching` and the simulator's `SimOptions.batching`.
BATCHINGS = ("shared", "splitwise", "ecoserve")


def batch_policy_for(name: str, prompt_tokens: int = PROMPT_TOKENS, clock: Callable[[], float] = lambda: 0.0,
                     ) -> Callable[[KVLedger, BatchConfig], BatchPolicy]:
    """The batch policy factory a node runs by name: the shared policy, Splitwise's machine-level one, or
    EcoServe's temporal disaggregation (`temporal_batching.py`, its t_switch read off `clock`)."""
    if name == "shared":
        return BatchPolicy
    if name == "splitwise":
        return splitwise_policy(MachineConfig(prompt_tokens=prompt_tokens))
    if name == "ecoserve":
        from hetnode.policy.temporal_batching import temporal_policy  # it builds on this module's neighbours

        return temporal_policy(clock)
    raise ValueError(f"batching must be one of {', '.join(BATCHINGS)}, not {name!r}")
