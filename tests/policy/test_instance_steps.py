"""The instance scheduler: temporal phases (prefill first, then back to decode), Sarathi's hybrid steps, KV
admission and recompute preemption, and the status Algorithm 2 reads."""

from __future__ import annotations

import pytest

from hetnode.policy.instance_steps import DECODE, HYBRID, PREFILL, InstanceConfig, InstanceScheduler


def run_step(s: InstanceScheduler, now: float, ended: tuple[int, ...] = ()) -> tuple[str, list[int]]:
    plan = s.next_step(now)
    assert plan is not None
    return plan.kind, s.step_done(plan, now + 0.1, ended)


def test_separate_prefills_first_and_switches_back_to_decode() -> None:
    s = InstanceScheduler(InstanceConfig(kv_tokens=10_000))
    s.route(0, 100, 0.0)
    assert run_step(s, 0.0) == (PREFILL, [0])
    assert run_step(s, 0.1) == (DECODE, [0])
    assert s.switched_at == pytest.approx(0.1)  # the prefill phase ended when the first decode step began
    s.route(1, 50, 0.15)
    kind, produced = run_step(s, 0.2)
    assert (kind, produced) == (PREFILL, [1])  # the new prompt interrupts the decodes
    state = s.status()
    assert [d.output_len for d in state.decodes] == [2, 1]  # both decode now, the new one too
    assert [d.first_token_at for d in state.decodes] == pytest.approx([0.1, 0.3])
    assert state.routed == 2


def test_no_more_requests_run_than_max_decodes_the_rest_wait_unprefilled() -> None:
    """vLLM's max_num_seqs bounds the running set: a request past it waits in the queue (its wait is TTFT), not
    prefilled to starve for a decode slot (its TPOT)."""
    s = InstanceScheduler(InstanceConfig(kv_tokens=10_000, max_decodes=2))
    for rid in range(3):
        s.route(rid, 10, 0.0)
    assert run_step(s, 0.0) == (PREFILL, [0, 1])
    assert run_step(s, 0.1) == (DECODE, [0, 1]) and [h.rid for h in s.waiting] == [2]
    assert run_step(s, 0.2, ended=(0,)) == (DECODE, [0, 1])
    assert run_step(s, 0.3) == (PREFILL, [2])  # 0 ended: room for the third


def test_hybrid_steps_carry_decodes_and_chunks_within_the_budget() -> None:
    s = InstanceScheduler(InstanceConfig(discipline=HYBRID, token_budget=64, kv_tokens=10_000))
    s.route(0, 100, 0.0)
    plan = s.next_step(0.0)
    assert plan is not None and plan.chunks == ((0, 0, 64),)
    s.step_done(plan, 0.1, ())
    s.route(1, 30, 0.1)
    plan = s.next_step(0.1)
    assert plan is not None and plan.chunks == ((0, 64, 36), (1, 0, 28))
    s.step_done(plan, 0.2, ())
    plan = s.next_step(0.2)
    assert plan is not None and plan.decodes == ((0, 101),) and plan.chunks == ((1, 28, 2),)


def test_admission_waits_for_kv_and_preemption_requeues_the_youngest() -> None:
    s = InstanceScheduler(InstanceConfig(kv_tokens=100))
    s.route(0, 60, 0.0)
    s.route(1, 60, 0.0)
    plan = s.next_step(0.0)
    assert plan is not None and [c[0] for c in plan.chunks] == [0]  # 1 does not fit beside 0
    s.step_done(plan, 0.1, ())
    s.running[0].output = 45  # grown past the pool (as decodes would)
    s.route(2, 10, 0.1)
    plan = s.next_step(0.1)
    assert plan is not None
    # 0 alone overflows: a lone request is never preempted, and nothing new is admitted beside it.
    assert s.step_done(plan, 0.2, ()) == [0] and list(s.running) == [0]
    s.step_done(s.next_step(0.2) or plan, 0.3, (0,))  # 0 ends and frees its KV
    plan = s.next_step(0.3)
    assert plan is not None and [c[0] for c in plan.chunks] == [1, 2]  # both fit the freed pool


def test_overflow_preempts_the_youngest_and_requeues_it_first() -> None:
    s = InstanceScheduler(InstanceConfig(kv_tokens=100))
    for rid in (0, 1):
        s.route(rid, 40, 0.0)
    plan = s.next_step(0.0)
    assert plan is not None
    s.step_done(plan, 0.1, ())
    s.running[1].output = 30  # 40 + 1 + 40 + 30 > 100
    s.step_done(s.next_step(0.1) or plan, 0.2, ())
    assert s.preempted == [1] and list(s.running) == [0]
    assert s.waiting[0].rid == 1 and s.waiting[0].prompt == 40 + 31  # re-prefills its prompt and output


def test_adopted_requests_only_decode() -> None:
    s = InstanceScheduler(InstanceConfig(kv_tokens=1000))
    s.adopt(7, 200, 1.0)
    plan = s.next_step(1.0)
    assert plan is not None and plan.kind == DECODE and plan.decodes == ((7, 201),)


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError):
        InstanceConfig(discipline="fifo")
    with pytest.raises(ValueError):
        InstanceScheduler().route(0, 0, 0.0)
