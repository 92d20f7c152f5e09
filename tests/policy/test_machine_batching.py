"""Splitwise's machine-level scheduler (§IV-B) alone: each rule on a queue built to show it."""

from __future__ import annotations

import pytest
from batch_items import It

from hetnode.policy import BatchConfig, KVLedger
from hetnode.policy.machine_batching import MachineConfig, SplitwiseBatchPolicy


def prompt(s: str, n: int) -> It:
    return It(s, 0, n)


def decode(s: str, at: int = 100) -> It:
    return It(s, at, 1, prefill_end=at)


def policy(blocks: int = 10_000, budget: int = 8192, **machine: float) -> SplitwiseBatchPolicy:
    return SplitwiseBatchPolicy(KVLedger(blocks, 16), BatchConfig(max_batch_tokens=budget),
                                MachineConfig(**machine))  # type: ignore[arg-type]


def names(items: list[It]) -> list[str]:
    return [it.session for it in items]


def test_prompt_machine_batches_prompts_first_come_up_to_2048_tokens() -> None:
    p = policy()
    q = [prompt("a", 1000), prompt("b", 1000), prompt("c", 100), prompt("d", 10)]
    step = p.form(q)
    # c would fit beside a and b alone; it would not beside them, so it and everything behind it waits (FCFS).
    assert names(step.batch) == ["a", "b"] and step.split is None and p.mode == "prompt"
    assert step.waiting == [q[2], q[3]]
    assert names(p.form(step.waiting).batch) == ["c", "d"]


def test_a_prompt_over_the_cap_runs_alone_and_whole() -> None:
    p = policy()
    q = [prompt("big", 5000), prompt("small", 10)]
    step = p.form(q)
    assert names(step.batch) == ["big"] and step.split is None and step.waiting == [q[1]]


def test_the_prompt_cap_is_a_setting() -> None:
    q = [prompt("a", 600), prompt("b", 600), prompt("c", 600), prompt("d", 600)]
    assert len(policy().form(q).batch) == 3
    assert len(policy(prompt_tokens=1200).form(q).batch) == 2
    assert len(policy(prompt_tokens=4096).form(q).batch) == 4


def test_a_prompt_over_the_engine_budget_is_split_to_it() -> None:
    step = policy(budget=1024).form([prompt("big", 3000)])
    assert step.split is not None and step.split_tokens == 1024


def test_token_machine_batches_every_decode_it_holds() -> None:
    p = policy(blocks=100)
    for s in "abcdefgh":
        assert p.ledger.reserve(s, 100)  # their KV came by hand-off
    q = [decode(s) for s in "abcdefgh"]
    step = p.form(q)
    assert names(step.batch) == list("abcdefgh") and p.mode == "token"


def test_token_machine_queues_new_sessions_near_full_memory() -> None:
    p = policy(blocks=100, high_water=0.9)
    assert p.ledger.reserve("held", 86 * 16)
    # new needs 5 blocks (86 + 5 > 90% of 100); later's 2 would fit, but it came after new.
    q = [decode("held", 100), decode("new", 64), decode("later", 16)]
    step = p.form(q)
    assert names(step.batch) == ["held"] and step.waiting == [q[1], q[2]]  # first come first admitted
    loose = policy(blocks=100, high_water=1.0)
    assert loose.ledger.reserve("held", 86 * 16)
    assert names(loose.form(q).batch) == ["held", "new", "later"]


def test_mixed_machine_runs_prompts_before_decodes() -> None:
    p = policy(budget=2100)
    for s in ("d1", "d2", "d3"):
        p.ledger.reserve(s, 101)
    q = [decode("d1"), decode("d2"), prompt("p", 2098), decode("d3")]
    step = p.form(q)
    # The prompt goes first; two decodes fill the budget left; the third is passed over.
    assert p.mode == "mixed" and names(step.batch) == ["p", "d1", "d2"] and step.waiting == [q[3]]
    assert p.age["d3"] == 1 and p.age["d1"] == 0


def test_an_aged_decode_goes_ahead_of_prompts_so_tokens_never_starve() -> None:
    p = policy(budget=2048, max_wait_steps=3)
    p.ledger.reserve("d", 101)
    runs = []
    for i in range(8):
        step = p.form([prompt(f"p{i}", 2048), decode("d")])
        runs.append(names(step.batch))
    # Three steps of prompts pass the decode over; then it runs first, and the prompt is split to what is left;
    # and so on, every fourth step.
    assert runs == [["p0"], ["p1"], ["p2"], ["d", "p3"], ["p4"], ["p5"], ["p6"], ["d", "p7"]]
    with_no_ageing = policy(budget=2048, max_wait_steps=1000)
    with_no_ageing.ledger.reserve("d", 101)
    assert all(names(with_no_ageing.form([prompt(f"p{i}", 2048), decode("d")]).batch) == [f"p{i}"]
               for i in range(6))


def test_mixed_machine_preempts_the_youngest_decodes_for_a_prompt() -> None:
    p = policy(blocks=20)
    p.ledger.reserve("old", 160)  # 10 blocks
    p.ledger.reserve("mid", 80)  # 5
    p.ledger.reserve("young", 80)  # 5
    q = [decode("old", 150), decode("mid", 70), decode("young", 70), prompt("p", 96)]  # p needs 6 blocks
    step = p.form(q)
    # Freeing the youngest (5) is not enough; mid goes too; old keeps running.
    assert step.preempted == ["young", "mid"] and names(step.dropped) == ["mid", "young"]
    assert names(step.batch) == ["p", "old"] and "young" not in p.ledger and p.preemptions["mid"] == 1


def test_no_preemption_when_it_would_not_make_room() -> None:
    p = policy(blocks=20)
    p.ledger.reserve("a", 160)
    p.ledger.reserve("b", 160)
    p.preemptions["a"] = 1  # a has been preempted once already: only b's 10 blocks could be freed
    step = p.form([decode("a", 150), prompt("p", 15 * 16), decode("b", 150)])
    assert step.preempted == [] and names(step.batch) == ["a", "b"] and names(step.blocked) == ["p"]
    assert "b" in p.ledger
    too_big = policy(blocks=20)
    too_big.ledger.reserve("a", 160)
    step = too_big.form([decode("a", 150), prompt("p", 21 * 16)])  # more than the whole pool: refused
    assert step.preempted == [] and names(step.refused) == ["p"] and names(step.batch) == ["a"]


def test_a_session_is_preempted_at_most_max_preemptions_times() -> None:
    p = policy(blocks=10, max_preemptions=1)
    p.ledger.reserve("d", 80)
    assert p.form([decode("d", 70), prompt("p1", 160)]).preempted == ["d"]
    p.ledger.release("p1")
    p.ledger.reserve("d", 80)  # d came back here and holds its KV again
    step = p.form([decode("d", 70), prompt("p2", 160)])
    assert step.preempted == [] and names(step.batch) == ["d"]  # protected now: the prompt waits
    never = policy(blocks=10, max_preemptions=0)
    never.ledger.reserve("d", 80)
    assert never.form([decode("d", 70), prompt("p", 160)]).preempted == []


def test_bad_settings_are_refused() -> None:
    for bad in ({"prompt_tokens": 0}, {"high_water": 0.0}, {"high_water": 1.5}, {"max_wait_steps": 0},
                {"max_preemptions": -1}):
        with pytest.raises(ValueError):
            MachineConfig(**bad)  # type: ignore[arg-type]
