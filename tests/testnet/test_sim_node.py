"""The simulated compute node: step times from the profile, batching as the runtime's, KV admission."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_helpers import PROFILE, Item, sessions

from hetnode.ids import SessionId
from hetnode.kv import KVUsage
from hetnode.node.batcher import BatchLoop, Work
from hetnode.node.engine.base import EngineConfig, StepItem
from hetnode.planner.profile import interpolate
from hetnode.policy import PREEMPTED, BatchConfig, BatchPolicy, KVLedger
from hetnode.policy.machine_batching import MachineConfig, splitwise_policy
from hetnode.policy.role_batching import prompt_tokens_for
from hetnode.testnet.sim.node import SimNode, add_to_bins

WINDOW = (0.0, 1000.0)


def node(first: int = 0, last: int = 2, *, kv_tokens: int = 1 << 20, budget: int = 8192,
         mixed_steps: str = "sum") -> SimNode:
    return SimNode(0, "n", "a100", PROFILE, first, last, kv_capacity_tokens=kv_tokens, block_size=16,
                   max_batch_tokens=budget, window=WINDOW, bin_s=10.0, mixed_steps=mixed_steps)


def test_decode_step_is_the_profiles_decode_time() -> None:
    n = node()
    n.slot(0, 2)
    n.queue = [Item("x", 1, pf=False, start=10), Item("y", 1, pf=False, start=20)]
    # Two sequences attending to 11 and 21 tokens, two layers.
    assert n.form_batch(0.0) == PROFILE.decode_time(2, 2, 11 + 21)
    assert sessions(n.batch) == ["x", "y"] and n.queue == []


def test_mixed_step_is_prefill_plus_decode() -> None:
    n = node()
    n.slot(0, 2)
    n.queue = [Item("p", 100, pf=True), Item("d", 1, pf=False, start=50)]
    assert n.form_batch(0.0) == PROFILE.prefill_time(100, 2) + PROFILE.decode_time(1, 2, 51)
    assert n.prompt_tokens == 100 and n.tokens == 101 and n.steps == 1


def test_helixs_solo_decode_factor_also_prices_one_decode_beside_a_prompt() -> None:
    def mixed(beside: bool) -> float:
        n = SimNode(0, "n", "a100", PROFILE, 0, 2, kv_capacity_tokens=1 << 20, block_size=16, max_batch_tokens=8192,
                    window=WINDOW, bin_s=10.0, solo_decode_factor=2.0, solo_beside_prompts=beside)
        n.slot(0, 2)
        n.queue = [Item("p", 100, pf=True), Item("d", 1, pf=False, start=50)]
        return n.form_batch(0.0)

    plain = PROFILE.prefill_time(100, 2) + PROFILE.decode_time(1, 2, 51)
    assert mixed(False) == plain  # the factor only prices a decode item alone
    # Helix's ModelLayer doubles the decode part of every layer whose batch has exactly one decode item.
    assert mixed(True) == pytest.approx(plain + 2 * interpolate(PROFILE.decode_curve, 1), rel=1e-12)


@pytest.mark.parametrize("beside", [False, True])
def test_one_decode_alone_costs_the_solo_factor_once_either_way(beside: bool) -> None:
    n = SimNode(0, "n", "a100", PROFILE, 0, 2, kv_capacity_tokens=1 << 20, block_size=16, max_batch_tokens=8192,
                window=WINDOW, bin_s=10.0, solo_decode_factor=2.0, solo_beside_prompts=beside)
    n.slot(0, 2)
    n.queue = [Item("d", 1, pf=False, start=50)]
    assert n.form_batch(0.0) == pytest.approx(2.0 * PROFILE.decode_time(1, 2, 51), rel=1e-12)


def test_the_input_copy_is_charged_on_layer_0_or_at_every_nodes_first_layer() -> None:
    def step(first: int, every: bool) -> float:
        n = SimNode(0, "n", "a100", PROFILE, first, first + 2, kv_capacity_tokens=1 << 20, block_size=16,
                    max_batch_tokens=8192, window=WINDOW, bin_s=10.0, first_layer_copy_s=1e-3, copy_every_node=every)
        n.slot(first, first + 2)
        n.queue = [Item("p", 100, pf=True), Item("d", 1, pf=False, start=50)]
        return n.form_batch(0.0)

    compute = PROFILE.prefill_time(100, 2) + PROFILE.decode_time(1, 2, 51)
    assert step(0, False) == pytest.approx(compute + 101e-3, rel=1e-12)
    assert step(10, False) == compute  # a later stage copies nothing unless every node does
    # Helix's ComputeNode adds the copy of what it received at its own first layer, on every node.
    assert step(10, True) == pytest.approx(compute + 101e-3, rel=1e-12)


def _batched(prompt: int, decodes: int, context: int) -> float:
    """One layer of a mixed step run as one pass (mixed_steps="batched")."""
    return (max(interpolate(PROFILE.prompt_curve, prompt + decodes), interpolate(PROFILE.decode_curve, decodes))
            + PROFILE.decode_context_s * context)


def test_batched_mixed_step_is_one_pass_over_all_its_tokens() -> None:
    n = node(mixed_steps="batched")
    n.slot(0, 2)
    n.queue = [Item("p", 100, pf=True), Item("d", 1, pf=False, start=50), Item("e", 1, pf=False, start=9)]
    assert n.form_batch(0.0) == pytest.approx(2 * _batched(100, 2, 51 + 10), rel=1e-12)
    # Less than prefill + decode, at least the decode alone.
    assert n.busy_s < PROFILE.prefill_time(100, 2) + PROFILE.decode_time(2, 2, 61)
    assert n.busy_s >= PROFILE.decode_time(2, 2, 61)
    # Steps that are not mixed cost what they cost under "sum".
    n.batch = None
    n.queue = [Item("p2", 100, pf=True)]
    assert n.form_batch(1.0) == PROFILE.prefill_time(100, 2)
    n.batch = None
    n.queue = [Item("d", 1, pf=False, start=51)]
    assert n.form_batch(2.0) == PROFILE.decode_time(1, 2, 52)


def test_batched_mixed_step_over_the_budget_and_in_slices() -> None:
    # The general path (the queue holds more tokens than the budget): the step that runs is priced the same.
    n = node(budget=110, mixed_steps="batched")  # 9 tokens left for q: less than a piece worth splitting off
    n.slot(0, 2)
    n.queue = [Item("p", 100, pf=True), Item("d", 1, pf=False, start=50), Item("q", 100, pf=True)]
    assert n.form_batch(0.0) == pytest.approx(2 * _batched(100, 1, 51), rel=1e-12)
    assert sessions(n.batch) == ["p", "d"] and sessions(n.queue) == ["q"]
    # Partial inference: layers 0-1 run the prompt alone, layers 2-3 run the prompt and the decode together.
    m = node(0, 4, mixed_steps="batched")
    full, tail = m.slot(0, 4), m.slot(2, 4)
    m.queue = [Item("p", 100, pf=True, seg={0: full}), Item("d", 1, pf=False, start=19, seg={0: tail})]
    expected = 2 * interpolate(PROFILE.prompt_curve, 100) + 2 * _batched(100, 1, 20)
    assert m.form_batch(0.0) == pytest.approx(expected, rel=1e-12)


def test_mixed_steps_must_be_known() -> None:
    from hetnode.errors import ConfigError
    from hetnode.testnet.sim import SimOptions

    with pytest.raises(ValueError, match="mixed_steps"):
        node(mixed_steps="max")
    with pytest.raises(ConfigError, match="mixed_steps"):
        SimOptions(mixed_steps="max")


def test_partial_inference_costs_each_layer_for_the_items_that_run_it() -> None:
    n = node(0, 4)
    full, tail = n.slot(0, 4), n.slot(2, 4)
    assert (full, tail) == (0, 1) and not n.single
    n.queue = [Item("full", 1, pf=False, start=9, seg={0: full}), Item("tail", 1, pf=False, start=19, seg={0: tail})]
    d1, d2 = interpolate(PROFILE.decode_curve, 1), interpolate(PROFILE.decode_curve, 2)
    ctx = PROFILE.decode_context_s
    # Layers 0-1 run "full" alone; layers 2-3 run both.
    expected = 2 * (d1 + ctx * 10) + 2 * (d2 + ctx * (10 + 20))
    assert n.form_batch(0.0) == pytest.approx(expected, rel=1e-12)


def test_slot_refuses_layers_the_node_does_not_hold() -> None:
    with pytest.raises(ValueError, match="holds"):
        node(0, 2).slot(1, 3)


def test_prompt_waits_for_kv_and_runs_after_a_release() -> None:
    n = node(kv_tokens=64)  # four blocks of 16
    n.ledger.reserve("c", 6)  # c's prompt ran earlier: one block
    a = Item("a", 40, pf=True)  # three blocks
    b = Item("b", 20, pf=True)  # two
    c = Item("c", 1, pf=False, start=5)
    d = Item("d", 10, pf=True)  # would fit in what a leaves, but first come, first admitted
    n.queue = [a, b, c, d]
    assert n.form_batch(0.0) > 0
    assert sessions(n.batch) == ["a", "c"] and sessions(n.queue) == ["b", "d"]
    assert n.kv_used == 4 and n.kv_waits == 2
    n.batch = None
    assert n.form_batch(1.0) == -1.0  # nothing can run: both prompts still blocked
    assert n.batch is None and sessions(n.queue) == ["b", "d"]
    n.release("a", 5.0)  # a's Release
    assert n.form_batch(5.0) > 0
    assert sessions(n.batch) == ["b", "d"] and n.kv_used == 4 and n.kv_peak == 4
    assert b.kv_wait == 5.0 and n.kv_wait_s == 10.0


def test_a_prompt_larger_than_the_pool_is_refused_unless_oversized_prompts_are_admitted() -> None:
    n = node(kv_tokens=64)
    big = Item("big", 500, pf=True)
    n.queue = [big]
    assert n.form_batch(0.0) == -1.0 and n.failed == [(big, n.policy.refusal(big), "refused")]
    lax = SimNode(0, "n", "a100", PROFILE, 0, 2, kv_capacity_tokens=64, block_size=16, max_batch_tokens=8192,
                  window=WINDOW, bin_s=10.0, admit_oversized=True)
    lax.queue = [Item("big", 500, pf=True)]
    assert lax.form_batch(0.0) > 0
    assert lax.kv_used == 32 and lax.kv_peak == 32 > lax.kv_capacity


def test_later_prompt_chunks_need_no_admission() -> None:
    n = node(kv_tokens=16 * 40)
    n.queue = [Item("s", 512, pf=True, prefill_end=612)]  # the first chunk reserves the whole prompt
    assert n.form_batch(0.0) > 0 and n.kv_used == 39
    n.batch = None
    n.queue = [Item("other", 16, pf=True), Item("s", 100, pf=True, start=512, prefill_end=612)]
    assert n.form_batch(1.0) > 0 and sessions(n.batch) == ["other", "s"] and n.kv_used == 40


def test_a_decode_that_cannot_grow_preempts_the_youngest() -> None:
    n = node(kv_tokens=32)  # two blocks
    n.ledger.reserve("old", 16)
    n.ledger.reserve("young", 16)
    old, young = Item("old", 1, pf=False, start=16), Item("young", 1, pf=False, start=16)
    n.queue = [old, young]  # both cross into a second block; none is free
    assert n.form_batch(0.0) > 0
    assert sessions(n.batch) == ["old"] and n.failed == [(young, PREEMPTED, "preempted")] and n.queue == []


def test_a_split_chunk_sends_a_piece_and_keeps_the_rest_in_place() -> None:
    n = node(budget=100)
    d, p, e = Item("d", 1, pf=False, start=3), Item("p", 512, pf=True), Item("e", 1, pf=False, start=9)
    n.queue = [d, p, e]
    assert n.form_batch(0.0) > 0
    piece = n.batch[1]  # type: ignore[index]
    assert sessions(n.batch) == ["d", "p"] and piece is not p and piece.origin is p
    assert (piece.start, piece.num_tokens) == (0, 99) and (p.start, p.num_tokens) == (99, 413)
    assert n.queue == [p, e] and n.tokens == 100 and n.prompt_tokens == 99


def test_busy_time_bins_and_window() -> None:
    bins: list[float] = []
    add_to_bins(bins, 10.0, 5.0, 27.0)
    assert bins == [5.0, 10.0, 7.0]
    n = SimNode(0, "n", "a100", PROFILE, 0, 2, kv_capacity_tokens=1 << 20, block_size=16, max_batch_tokens=8192,
                window=(0.0, 0.005), bin_s=10.0)
    n.queue = [Item("x", 1, pf=False)]
    dur = n.form_batch(0.0)
    assert n.busy_s == dur and n.window_busy_s == pytest.approx(min(dur, 0.005))


# -- the runtime's batch loop and the simulated node choose the same batches ---------------------------------
#
# Both run hetnode.policy.BatchPolicy; what is checked here is everything around it: what each executor feeds the
# policy (its queue, releases, KV capacity), how it applies a split (the loop slices the StepItem, the node
# clones a piece), what it does with refused and preempted items. A driver plays the coordinator: sessions
# arrive, each item that completes is followed by the session's next one (the next prompt chunk, then decode
# tokens), a finished session is released; both executors see the same arrivals and releases, round by round.


class _FakeEngine:
    def __init__(self, budget: int, blocks: int) -> None:
        self.engine_config = EngineConfig(max_batch_tokens=budget)
        self.blocks = blocks

    def kv_usage(self) -> KVUsage:
        return KVUsage(block_size=16, total_blocks=self.blocks, used_blocks=0, free_blocks=self.blocks, sessions=0,
                       tokens=0)


Session = tuple[int, int, int, int]  # (arrival round, prompt tokens, prefill chunk, tokens to generate)
Round = tuple[list[tuple[str, int, int]], list[tuple[str, str, str]]]  # (batch: (session, start, n), failures)


class _Driver:
    """The coordinator's side: which items arrive and which sessions end, given what the last step ran."""

    def __init__(self, plan: list[Session]) -> None:
        self.plan = plan
        self.end: dict[str, int] = {}  # session -> end of its item in flight
        self.left: dict[str, int] = {}

    def arrivals(self, rnd: int, ran: list[tuple[str, int, int]], failed: list[str],
                 ) -> tuple[list[tuple[str, int, int, int]], list[str]]:
        """New items (session, start, n, prefill_end) and sessions to release, after a round that ran `ran`."""
        items: list[tuple[str, int, int, int]] = []
        releases: list[str] = []
        for s in failed:
            self.end.pop(s, None)
        for s, start, n in ran:
            if s not in self.end or start + n != self.end[s]:
                continue  # a piece: the rest of the chunk is still queued
            i = int(s[1:])
            _, prompt, chunk, _ = self.plan[i]
            end = start + n
            if end < prompt:
                items.append((s, end, min(chunk, prompt - end), prompt))
            elif self.left[s] > 0:
                self.left[s] -= 1
                items.append((s, end, 1, prompt))
            else:
                del self.end[s]
                releases.append(s)
                continue
            self.end[s] = items[-1][1] + items[-1][2]
        for i, (arrive, prompt, chunk, gen) in enumerate(self.plan):
            if arrive == rnd:
                s = f"s{i}"
                self.left[s] = gen
                items.append((s, 0, min(chunk, prompt), prompt))
                self.end[s] = min(chunk, prompt)
        return items, releases


async def _runtime_rounds(budget: int, blocks: int, min_chunk: int, plan: list[Session],
                          policy: Any = BatchPolicy, caps: tuple[int | None, int | None] = (None, None),
                          prompt_tokens: int | None = None) -> list[Round]:
    failures: list[tuple[str, str, str]] = []

    async def nothing(*args: Any) -> None:
        return None

    async def fail(work: Work, reason: str, cause: str) -> None:
        failures.append((str(work.item.session), reason, cause))

    loop = BatchLoop(_FakeEngine(budget, blocks), deliver=nothing, fail=fail,  # type: ignore[arg-type]
                     min_chunk=min_chunk, policy=policy, max_prompts=caps[0], max_decodes=caps[1],
                     prompt_tokens=prompt_tokens)
    driver = _Driver(plan)
    out: list[Round] = []
    ran: list[tuple[str, int, int]] = []
    failed: list[str] = []
    for rnd in range(400):
        items, releases = driver.arrivals(rnd, ran, failed)
        for s in releases:
            loop.release(SessionId(s))
        for s, start, n, end in items:
            await loop.submit(Work(StepItem(SessionId(s), start, token_ids=[1] * n), prefill_end=end))
        if not (loop._deferred or items or releases) and rnd > max(p[0] for p in plan):
            break
        if loop._stalled or not (loop._deferred or items):
            loop._send.send_nowait(None)  # what a release or a new item does: wake the loop
        batch = await loop._next_batch()
        loop._take_releases()  # what the step would do before running
        ran = [(str(w.item.session), w.item.start, w.item.num_tokens) for w in batch]
        failed = [s for s, *_ in failures]
        out.append((ran, sorted(failures)))
        failures.clear()
    return out


def _sim_rounds(budget: int, blocks: int, min_chunk: int, plan: list[Session], policy: Any = BatchPolicy,
                caps: tuple[int | None, int | None] = (None, None), prompt_tokens: int | None = None,
                ) -> list[Round]:
    n = SimNode(0, "n", "a100", PROFILE, 0, 2, kv_capacity_tokens=blocks * 16, block_size=16,
                max_batch_tokens=budget, window=WINDOW, bin_s=10.0, min_chunk=min_chunk, policy=policy,
                max_prompts=caps[0], max_decodes=caps[1], prompt_tokens=prompt_tokens)
    driver = _Driver(plan)
    out: list[Round] = []
    ran: list[tuple[str, int, int]] = []
    failed: list[str] = []
    for rnd in range(400):
        items, releases = driver.arrivals(rnd, ran, failed)
        for s in releases:
            n.release(s, 0.0)  # type: ignore[arg-type]
        n.queue.extend(Item(s, k, pf=start < end, start=start, prefill_end=end) for s, start, k, end in items)
        if not (n.queue or items or releases) and rnd > max(p[0] for p in plan):
            break
        n.batch = None
        n.form_batch(0.0)
        ran = [(str(r.session), r.start, r.num_tokens) for r in n.batch or []]
        failures = sorted((str(r.session), reason, cause) for r, reason, cause in n.failed)
        failed = [s for s, *_ in failures]
        n.failed = []
        out.append((ran, failures))
    return out


def _one_item_each(items: list[tuple[str, int]]) -> list[Session]:
    return [(0, k, k, 0) for _, k in items]


@pytest.mark.parametrize("budget, items", [
    (100, [("p60", 60), ("d1", 1), ("p50", 50), ("d2", 1), ("p38", 38), ("d3", 1)]),
    (10, [("d1", 1), ("big", 30), ("d2", 1), ("p9", 9), ("d3", 1)]),  # an oversized item runs alone, first
    (3, [(f"d{i}", 1) for i in range(8)]),  # decode items over the budget
    (8192, [("p512", 512), *((f"d{i}", 1) for i in range(50)), ("p300", 300)]),
])
async def test_batches_mirror_the_runtime_batch_loop(budget: int, items: list[tuple[str, int]]) -> None:
    plan = _one_item_each(items)
    assert _sim_rounds(budget, 1 << 16, 16, plan) == await _runtime_rounds(budget, 1 << 16, 16, plan)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 200), st.integers(1, 96), st.integers(0, 40)),
                     min_size=1, max_size=10),
       budget=st.integers(1, 160), blocks=st.integers(1, 40), min_chunk=st.integers(1, 32))
async def test_kv_admission_chunking_growth_and_preemption_mirror_the_runtime(
        plan: list[Session], budget: int, blocks: int, min_chunk: int) -> None:
    runtime = await _runtime_rounds(budget, blocks, min_chunk, plan)
    assert _sim_rounds(budget, blocks, min_chunk, plan) == runtime


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 120), st.integers(1, 64), st.integers(0, 12)),
                     min_size=1, max_size=12),
       budget=st.integers(1, 400), prompts=st.none() | st.integers(1, 3), decodes=st.none() | st.integers(1, 5))
async def test_step_caps_decide_alike_in_the_runtime_and_the_simulator(
        plan: list[Session], budget: int, prompts: int | None, decodes: int | None) -> None:
    runtime = await _runtime_rounds(budget, 1 << 16, 16, plan, caps=(prompts, decodes))
    assert _sim_rounds(budget, 1 << 16, 16, plan, caps=(prompts, decodes)) == runtime


async def test_a_prompt_cap_holds_the_second_prompt_in_both_executors() -> None:
    """The mirror is not vacuous: with one prompt a step, two prompts arriving together run in two rounds."""
    plan = [(0, 8, 8, 0), (0, 8, 8, 0)]
    capped = await _runtime_rounds(100, 1 << 16, 16, plan, caps=(1, None))
    assert [len(ran) for ran, _ in capped[:2]] == [1, 1]
    assert [len(ran) for ran, _ in await _runtime_rounds(100, 1 << 16, 16, plan)][:1] == [2]
    assert _sim_rounds(100, 1 << 16, 16, plan, caps=(1, None)) == capped


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(st.tuples(st.integers(0, 4), st.integers(1, 120), st.integers(1, 64), st.integers(0, 12)),
                     min_size=1, max_size=12),
       budget=st.integers(1, 400), blocks=st.integers(4, 60), role=st.sampled_from(["prefill", "decode", None]),
       prefill_tokens=st.none() | st.integers(1, 150))
async def test_a_replicas_role_setting_decides_alike_in_the_runtime_and_the_simulator(
        plan: list[Session], budget: int, blocks: int, role: str | None, prefill_tokens: int | None) -> None:
    """The prompt-token cap a replica's role gives its nodes (role_batching.py), through both executors."""
    cap = prompt_tokens_for(role, prefill_tokens)
    runtime = await _runtime_rounds(budget, blocks, 16, plan, prompt_tokens=cap)
    assert _sim_rounds(budget, blocks, 16, plan, prompt_tokens=cap) == runtime


async def test_a_prefill_replicas_steps_batch_prompts_up_to_its_cap_and_a_longer_one_alone() -> None:
    """Not vacuous: under a 100-token cap a prefill node runs 60 + 30, then 80 (the next 30 would pass the cap),
    then 30 + 40 + 20, then the 150 alone (longer than the cap: never held back), and the 10 behind it last (not
    run ahead of it); without the cap (a decode node's setting) all of them go in one step."""
    plan = [(0, 60, 60, 0), (0, 30, 30, 0), (0, 80, 80, 0), (0, 30, 30, 0), (0, 40, 40, 0), (0, 20, 20, 0),
            (0, 150, 150, 0), (0, 10, 10, 0)]
    cap = prompt_tokens_for("prefill", 100)
    rounds = await _runtime_rounds(1000, 1 << 16, 16, plan, prompt_tokens=cap)
    assert _sim_rounds(1000, 1 << 16, 16, plan, prompt_tokens=cap) == rounds
    assert [[s for s, *_ in ran] for ran, _ in rounds if ran] == [
        ["s0", "s1"], ["s2"], ["s3", "s4", "s5"], ["s6"], ["s7"]]
    assert prompt_tokens_for("decode", 100) is None
    shared = await _runtime_rounds(1000, 1 << 16, 16, plan)
    assert len(shared[0][0]) == len(plan)  # everything in one step without the cap


async def test_the_mirror_covers_every_kv_decision() -> None:
    """One workload that splits, queues for KV, grows, preempts and refuses, through both executors."""
    plan = [(0, 40, 40, 30), (0, 70, 32, 20), (1, 10, 10, 40), (2, 500, 64, 1), (3, 20, 8, 5)]
    rounds = await _runtime_rounds(48, 10, 8, plan)
    assert _sim_rounds(48, 10, 8, plan) == rounds
    reasons = {reason.split(":")[0] for _, failures in rounds for _, reason, _ in failures}
    assert reasons == {"preempted", "out of KV memory on this node"}
    assert any(len(ran) < 5 and sum(n for *_, n in ran) == 48 for ran, _ in rounds)  # a step filled by a split


class _SmallSteps(BatchPolicy):
    """Another design's batch policy: steps of at most 24 tokens, whatever the node's budget."""

    def __init__(self, ledger: KVLedger, config: BatchConfig) -> None:
        super().__init__(ledger, dataclasses.replace(config, max_batch_tokens=min(config.max_batch_tokens, 24)))


async def test_a_policy_object_of_another_design_runs_alike_in_both_executors() -> None:
    plan = [(0, 40, 40, 30), (0, 70, 32, 20), (1, 10, 10, 40), (3, 20, 8, 5)]
    rounds = await _runtime_rounds(96, 64, 8, plan, _SmallSteps)
    assert _sim_rounds(96, 64, 8, plan, _SmallSteps) == rounds
    assert rounds != await _runtime_rounds(96, 64, 8, plan)  # the policy object was the one that decided
    assert max(sum(n for *_, n in ran) for ran, _ in rounds) == 24


def test_sim_item_stand_in_has_the_fields_a_node_reads() -> None:
    from hetnode.testnet.sim.coordinator import SimRequest

    assert set(Item.__slots__) <= set(SimRequest.__slots__)


# -- Splitwise's machine-level scheduler (hetnode.policy.machine_batching) through both executors -------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 200), st.integers(1, 96), st.integers(0, 40)),
                     min_size=1, max_size=10),
       budget=st.integers(1, 160), blocks=st.integers(1, 40), prompt_tokens=st.integers(1, 200),
       wait=st.integers(1, 4), preemptions=st.integers(0, 2))
async def test_splitwise_machine_scheduling_decides_alike_in_the_runtime_and_the_simulator(
        plan: list[Session], budget: int, blocks: int, prompt_tokens: int, wait: int, preemptions: int) -> None:
    def make() -> Any:
        return splitwise_policy(MachineConfig(prompt_tokens=prompt_tokens, max_wait_steps=wait,
                                              max_preemptions=preemptions))

    runtime = await _runtime_rounds(budget, blocks, 8, plan, make())
    assert _sim_rounds(budget, blocks, 8, plan, make()) == runtime


async def test_the_splitwise_mirror_sees_its_own_decisions() -> None:
    """Not vacuous: the workload below batches prompts under the cap, preempts for a prompt on a mixed machine
    and runs an aged decode first, and the rounds differ from the shared policy's."""
    plan = [(0, 40, 40, 30), (0, 30, 30, 20), (1, 10, 10, 40), (2, 64, 64, 3), (3, 20, 20, 5), (4, 90, 90, 2)]

    def make() -> Any:
        return splitwise_policy(MachineConfig(prompt_tokens=48, max_wait_steps=2))

    rounds = await _runtime_rounds(96, 12, 8, plan, make())
    assert _sim_rounds(96, 12, 8, plan, make()) == rounds
    assert rounds != await _runtime_rounds(96, 12, 8, plan)
    assert [s for s, *_ in rounds[0][0]] == ["s0"]  # s1's 30 tokens do not fit beside s0's 40 under 48
    assert any(cause == "preempted" for _, failures in rounds for *_, cause in failures)
