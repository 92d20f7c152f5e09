"""The batch policy alone: budgets, sessions, order, chunked prefill, KV admission, growth and preemption."""

from __future__ import annotations

from dataclasses import replace

from batch_items import It
from hypothesis import given, settings
from hypothesis import strategies as st

from hetnode.policy import PREEMPTED, BatchConfig, BatchPolicy, KVLedger, Step


def policy(blocks: int = 1000, budget: int = 100, min_chunk: int = 4, **kw: bool) -> BatchPolicy:
    return BatchPolicy(KVLedger(blocks, 16), BatchConfig(max_batch_tokens=budget, min_chunk=min_chunk, **kw))


def names(items: list[It]) -> list[str]:
    return [it.session for it in items]


def test_a_step_takes_everything_within_the_budget_one_item_per_session() -> None:
    p = policy(budget=10)
    q = [It("a", 0, 3), It("b", 0, 1), It("a", 3, 1), It("c", 0, 9), It("d", 0, 1)]
    step = p.form(q)
    # a's second item waits for its first; c is split to the 6 tokens left; d finds the step full.
    assert names(step.batch) == ["a", "b", "c"] and step.split == q[3] and step.split_tokens == 6
    assert step.tokens == 10 and step.waiting == [q[2], q[3], q[4]]


def test_split_needs_min_chunk_beside_other_work_but_not_alone() -> None:
    p = policy(budget=10, min_chunk=4)
    q = [It("a", 0, 7), It("big", 0, 30), It("d", 0, 1)]
    step = p.form(q)
    assert names(step.batch) == ["a", "d"] and step.split is None and step.waiting == [q[1]]
    step = p.form(step.waiting)
    assert step.batch == [q[1]] and step.split == q[1] and step.split_tokens == 10


def test_a_prompt_reserves_its_whole_prefill_and_later_chunks_need_nothing() -> None:
    p = policy(blocks=4)
    step = p.form([It("a", 0, 16, prefill_end=64)])  # the first of four chunks reserves all four blocks
    assert step.batch and p.ledger.held("a") == 4
    assert p.form([It("a", 16, 48)]).batch and p.ledger.used == 4


def test_first_come_first_admitted_while_admitted_sessions_run() -> None:
    p = policy(blocks=4)
    p.ledger.reserve("old", 16)
    q = [It("a", 0, 40), It("b", 0, 20), It("old", 5, 1), It("c", 0, 10)]  # a: 3 blocks, b: 2, c: 1
    step = p.form(q)
    assert names(step.batch) == ["a", "old"] and step.blocked == [q[1], q[3]] and p.ledger.used == 4
    assert p.form(step.waiting).stalled  # b and c wait for a release; nothing can run
    p.ledger.release("a")
    assert names(p.form(step.waiting).batch) == ["b", "c"]


def test_decode_growth_waits_and_preemption_takes_the_youngest() -> None:
    p = policy(blocks=3)
    for s in ("x", "y", "z"):
        assert p.ledger.reserve(s, 16)
    q = [It("x", 16, 1), It("y", 16, 1), It("z", 16, 1)]  # all cross into a second block: none free
    step = p.form(q)
    # Nothing could run: z, the youngest, is preempted, which frees a block for x.
    assert step.preempted == ["z"] and step.dropped == [q[2]] and "z" not in p.ledger
    assert step.batch == [q[0]] and step.blocked == [q[1]] and step.waiting == [q[1]]
    assert PREEMPTED.startswith("preempted")


def test_no_preemption_while_only_new_sessions_wait() -> None:
    p = policy(blocks=2)
    p.ledger.reserve("held", 32)
    step = p.form([It("new", 0, 5)])
    assert step.stalled and not step.preempted and "held" in p.ledger


def test_a_prompt_larger_than_the_pool_is_refused_or_admitted_alone_when_asked() -> None:
    p = policy(blocks=2)
    q = [It("huge", 0, 40), It("huge", 40, 1), It("ok", 0, 5)]
    step = p.form(q)
    assert step.refused == q[:2] and names(step.batch) == ["ok"]
    assert "3 KV blocks (48 tokens)" in p.refusal(q[0]) and "pool is 2 blocks" in p.refusal(q[0])
    lax = policy(blocks=2, admit_oversized=True)
    assert lax.form([It("huge", 0, 40)]).batch and lax.ledger.used == 3  # a node holding nothing admits it
    assert lax.form([It("huge2", 0, 40)]).refused  # but not beside other KV


# -- properties over random workloads --------------------------------------------------------------------------


def check_step(p: BatchPolicy, queue: list[It], step: Step[It]) -> None:
    budget = p.config.max_batch_tokens
    assert step.tokens <= budget
    assert len(set(names(step.batch))) == len(step.batch)  # one item per session
    ids = [id(it) for it in queue]
    order = [ids.index(id(it)) for it in step.batch]
    assert order == sorted(order)  # arrival order
    assert [ids.index(id(it)) for it in step.waiting] == sorted(ids.index(id(it)) for it in step.waiting)
    accounted = {id(it) for it in step.batch if it is not step.split} | {id(it) for it in step.waiting}
    accounted |= {id(it) for it in step.refused} | {id(it) for it in step.dropped}
    assert accounted == set(ids)
    for it in step.batch:
        assert it.session in p.ledger
        taken = step.split_tokens if it is step.split else it.num_tokens
        assert it.start + taken <= p.ledger.held(it.session) * p.ledger.block_size
    if p.ledger.used > p.ledger.capacity:  # overcommit: only a lone oversized prompt
        assert p.config.admit_oversized and len(p.ledger) == 1


def drive(p: BatchPolicy, prompts: list[tuple[int, int]], chunk: int) -> list[str]:
    """Run sessions (prompt length, tokens to generate) to the end through the policy; returns what happened."""
    left = {f"s{i}": gen for i, (_, gen) in enumerate(prompts)}
    queue = [It(f"s{i}", 0, min(chunk, n), prefill_end=n) for i, (n, _) in enumerate(prompts)]
    events: list[str] = []
    for _ in range(10_000):
        if not queue:
            break
        step = p.form(queue)
        check_step(p, queue, step)
        for s in step.preempted:
            events.append(f"preempt {s}")
            left.pop(s, None)
        for it in step.refused:
            events.append(f"refuse {it.session}")
            left.pop(it.session, None)
        if step.stalled:
            events.append("stalled")
            break
        nxt = [replace(it, start=it.start + step.split_tokens, num_tokens=it.num_tokens - step.split_tokens)
               if it is step.split else it for it in step.waiting]
        for it in step.batch:
            if it is step.split:
                continue
            end = it.start + it.num_tokens
            if end < it.prefill_end:
                nxt.append(It(it.session, end, min(chunk, it.prefill_end - end), prefill_end=it.prefill_end))
                continue
            left[it.session] -= 1
            if left[it.session] <= 0:
                p.ledger.release(it.session)
                events.append(f"done {it.session}")
            else:
                nxt.append(It(it.session, end, 1, prefill_end=it.prefill_end))
        queue = nxt
    return events


@settings(max_examples=150, deadline=None)
@given(prompts=st.lists(st.tuples(st.integers(1, 120), st.integers(1, 40)), min_size=1, max_size=12),
       blocks=st.integers(1, 40), budget=st.integers(1, 80), chunk=st.integers(1, 64),
       min_chunk=st.integers(1, 16), oversized=st.booleans())
def test_random_workloads_keep_every_rule(prompts: list[tuple[int, int]], blocks: int, budget: int, chunk: int,
                                          min_chunk: int, oversized: bool) -> None:
    p = policy(blocks=blocks, budget=budget, min_chunk=min_chunk, admit_oversized=oversized)
    events = drive(p, prompts, chunk)
    # Every session ends: done, refused or preempted; the policy never deadlocks with admitted work waiting.
    assert "stalled" not in events
    ended = {e.split()[1] for e in events}
    assert ended == {f"s{i}" for i in range(len(prompts))}
    assert p.ledger.used == 0 and len(p.ledger) == 0  # preempted and finished sessions freed everything


@settings(max_examples=100, deadline=None)
@given(ages=st.permutations(["a", "b", "c", "d"]), blocked=st.sets(st.sampled_from("abcd"), min_size=1))
def test_preemption_picks_the_youngest_blocked_session(ages: list[str], blocked: set[str]) -> None:
    p = policy(blocks=len(ages))
    for s in ages:
        p.ledger.reserve(s, 16)
    q = [It(s, 16, 1) for s in sorted(blocked)]
    step = p.form(q)
    youngest = [s for s in ages if s in blocked][-1]
    assert step.preempted[0] == youngest and youngest not in p.ledger
    assert len(step.preempted) == 1 and len(step.batch) == min(1, len(blocked) - 1)


# -- per-step request caps (Helix's prompt_max_requests and decode_max_tokens) ------------------------------


def test_step_caps_bound_prompt_and_decode_items_apart() -> None:
    p = BatchPolicy(KVLedger(1000, 16), BatchConfig(max_batch_tokens=1000, max_prompts=1, max_decodes=2))
    # d*: decode items (they start at their prefill_end); p*: prompts.
    q = [It("p1", 0, 5), It("d1", 10, 1, 10), It("p2", 0, 5), It("d2", 10, 1, 10), It("d3", 10, 1, 10)]
    step = p.form(q)
    assert names(step.batch) == ["p1", "d1", "d2"]
    assert names(step.waiting) == ["p2", "d3"]  # over a cap: waits at its place for the next step


def test_without_caps_the_same_queue_runs_whole() -> None:
    q = [It("p1", 0, 5), It("d1", 10, 1, 10), It("p2", 0, 5), It("d2", 10, 1, 10), It("d3", 10, 1, 10)]
    assert names(policy(budget=1000).form(q).batch) == ["p1", "d1", "p2", "d2", "d3"]


def test_a_chunk_of_a_prompt_counts_as_a_prompt_item() -> None:
    p = BatchPolicy(KVLedger(1000, 16), BatchConfig(max_batch_tokens=1000, max_prompts=1))
    step = p.form([It("a", 16, 16, 64), It("b", 0, 16, 64)])  # a's second chunk, b's first
    assert names(step.batch) == ["a"] and names(step.waiting) == ["b"]


def test_step_caps_must_be_positive() -> None:
    import pytest

    with pytest.raises(ValueError, match="max_prompts"):
        BatchConfig(max_prompts=0)
    with pytest.raises(ValueError, match="max_decodes"):
        BatchConfig(max_decodes=-1)
    with pytest.raises(ValueError, match="prompt_tokens"):
        BatchConfig(prompt_tokens=0)


# -- prompt tokens per step (a prefill replica's setting, role_batching.py) ----------------------------------


def test_prompt_tokens_batch_prompts_in_order_up_to_the_cap_decodes_aside() -> None:
    p = BatchPolicy(KVLedger(1000, 16), BatchConfig(max_batch_tokens=1000, prompt_tokens=50))
    q = [It("p1", 0, 30), It("d1", 10, 1, 10), It("p2", 0, 30), It("p3", 0, 10), It("d2", 10, 1, 10)]
    step = p.form(q)
    # p2 would pass the cap and is not cut to fit: it ends the step's prompts, so p3 waits behind it.
    assert names(step.batch) == ["p1", "d1", "d2"] and names(step.waiting) == ["p2", "p3"]
    assert step.split is None


def test_a_prompt_longer_than_the_cap_runs_alone_split_only_by_the_budget() -> None:
    p = BatchPolicy(KVLedger(1000, 16), BatchConfig(max_batch_tokens=100, prompt_tokens=50))
    step = p.form([It("long", 0, 300), It("short", 0, 5)])
    assert names(step.batch) == ["long"] and step.split_tokens == 100


def test_set_prompt_tokens_changes_the_next_step_only() -> None:
    p = BatchPolicy(KVLedger(1000, 16), BatchConfig(max_batch_tokens=1000))
    q = [It("a", 0, 30), It("b", 0, 30)]
    assert names(p.form(q).batch) == ["a", "b"]
    p.ledger.release("a")
    p.ledger.release("b")
    p.set_prompt_tokens(40)
    assert names(p.form(q).batch) == ["a"] and p.config.prompt_tokens == 40
    p.set_prompt_tokens(None)
    assert names(p.form(q).batch) == ["a", "b"]
