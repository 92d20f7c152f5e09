"""EcoServe's instance scheduling on a node (§3.4): temporal disaggregation of a node's steps.

A node serving as an EcoServe instance holds the whole model and runs both phases, but never in one step: a step
is all prompt chunks or all decodes, chosen by the same rule (`instance_steps.PhaseSwitch`) that the PaDG
simulator's instances decide by. While a prompt can run (one that the shared batch policy would admit: KV room,
token budget) the node prefills; then it decodes until the macro-instance scheduler sends it the next burst of
requests. The decodes it pauses spend the TPOT they saved while decoding undisturbed; the coordinator's
scheduler (`coordinator/ecoserve_scheduler.py`) keeps the saved-TPOT account and sends new requests only where
it suffices (Algorithm 2).

Within a phase the shared batch policy forms the step (token budget, chunked prefill, KV admission and growth,
preemption), over the prompt items in a prefill step and over the decode items in a decode step; the items of
the other phase keep their places in the queue. A prefill phase whose prompts are all blocked (no KV room)
gives way to decoding, so that decodes free KV instead of deadlocking behind a prompt that waits for them.

No I/O; the clock is injected (it only timestamps t_switch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from hetnode.policy.batching import BatchConfig, BatchPolicy, Pending, Step
from hetnode.policy.instance_steps import DECODE, PREFILL, PhaseSwitch
from hetnode.policy.kv_ledger import KVLedger

T = TypeVar("T", bound=Pending)


class TemporalBatchPolicy(BatchPolicy):
    """See the module docstring; `phases` is the instance's phase and t_switch."""

    __slots__ = ("clock", "phases")

    def __init__(self, ledger: KVLedger, config: BatchConfig | None = None,
                 clock: Callable[[], float] = lambda: 0.0) -> None:
        super().__init__(ledger, config)
        self.clock = clock
        self.phases = PhaseSwitch()

    def form(self, queue: Sequence[T]) -> Step[T]:
        prompts = [it for it in queue if it.start < it.prefill_end]
        decodes = [it for it in queue if it.start >= it.prefill_end]
        prefill = super().form(prompts) if prompts else None
        ran = prefill is not None and bool(prefill.batch)
        phase = self.phases.next(ran, bool(decodes), self.clock())
        if phase == PREFILL:
            assert prefill is not None
            return _whole(prefill, queue, others=decodes)
        decode = super().form(decodes) if phase == DECODE else Step([], [], 0, None, 0, [], [])
        if prefill is not None:  # prompts refused or preempted while trying to prefill keep those outcomes
            decode.refused = prefill.refused + decode.refused
            decode.preempted = [*prefill.preempted, *decode.preempted]
            decode.dropped = prefill.dropped + decode.dropped
            decode.blocked = prefill.blocked + decode.blocked
        return _whole(decode, queue, others=[it for it in prompts if prefill is None or _in(it, prefill.waiting)])


def _in(item: Pending, items: Sequence[Pending]) -> bool:
    return any(it is item for it in items)


def _whole(step: Step[T], queue: Sequence[T], others: Sequence[T]) -> Step[T]:
    """The step with the other phase's items back in `waiting`, all in arrival order."""
    keep = {id(it) for it in step.waiting} | {id(it) for it in others}
    step.waiting = [it for it in queue if id(it) in keep]
    return step


def temporal_policy(clock: Callable[[], float]) -> Callable[[KVLedger, BatchConfig], BatchPolicy]:
    """The factory `BatchLoop` takes (`policy=`), its t_switch read off `clock`."""

    def make(ledger: KVLedger, config: BatchConfig) -> BatchPolicy:
        return TemporalBatchPolicy(ledger, config, clock)

    return make
