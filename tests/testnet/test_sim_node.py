"""The simulated compute node: step times from the profile, batching as the runtime's, KV admission."""

from __future__ import annotations

from typing import Any

import pytest
from sim_helpers import PROFILE, Item, sessions

from hetnode.ids import SessionId
from hetnode.kv import KVUsage
from hetnode.node.batcher import BatchLoop, Work
from hetnode.node.engine.base import EngineConfig, StepItem
from hetnode.planner.profile import interpolate
from hetnode.testnet.sim.node import SimNode, add_to_bins

WINDOW = (0.0, 1000.0)


def node(first: int = 0, last: int = 2, *, kv_tokens: int = 1 << 20, budget: int = 8192,
         mixed_steps: str = "sum") -> SimNode:
    return SimNode(0, "n", "a100", PROFILE, first, last, kv_capacity_tokens=kv_tokens, block_size=16,
                   max_batch_tokens=budget, window=WINDOW, bin_s=10.0, mixed_steps=mixed_steps)


def test_decode_step_is_the_profiles_decode_time() -> None:
    n = node()
    n.slot(0, 2)
    n.queue = [Item("x", 1, pf=False, pos=10), Item("y", 1, pf=False, pos=20)]
    # Two sequences attending to 11 and 21 tokens, two layers.
    assert n.form_batch(0.0) == PROFILE.decode_time(2, 2, 11 + 21)
    assert sessions(n.batch) == ["x", "y"] and n.queue == []


def test_mixed_step_is_prefill_plus_decode() -> None:
    n = node()
    n.slot(0, 2)
    n.queue = [Item("p", 100, pf=True), Item("d", 1, pf=False, pos=50)]
    assert n.form_batch(0.0) == PROFILE.prefill_time(100, 2) + PROFILE.decode_time(1, 2, 51)
    assert n.prompt_tokens == 100 and n.tokens == 101 and n.steps == 1


def _batched(prompt: int, decodes: int, context: int) -> float:
    """One layer of a mixed step run as one pass (mixed_steps="batched")."""
    return (max(interpolate(PROFILE.prompt_curve, prompt + decodes), interpolate(PROFILE.decode_curve, decodes))
            + PROFILE.decode_context_s * context)


def test_batched_mixed_step_is_one_pass_over_all_its_tokens() -> None:
    n = node(mixed_steps="batched")
    n.slot(0, 2)
    n.queue = [Item("p", 100, pf=True), Item("d", 1, pf=False, pos=50), Item("e", 1, pf=False, pos=9)]
    assert n.form_batch(0.0) == pytest.approx(2 * _batched(100, 2, 51 + 10), rel=1e-12)
    # Less than prefill + decode, at least the decode alone.
    assert n.busy_s < PROFILE.prefill_time(100, 2) + PROFILE.decode_time(2, 2, 61)
    assert n.busy_s >= PROFILE.decode_time(2, 2, 61)
    # Steps that are not mixed cost what they cost under "sum".
    n.batch = None
    n.queue = [Item("p2", 100, pf=True)]
    assert n.form_batch(1.0) == PROFILE.prefill_time(100, 2)
    n.batch = None
    n.queue = [Item("d", 1, pf=False, pos=51)]
    assert n.form_batch(2.0) == PROFILE.decode_time(1, 2, 52)


def test_batched_mixed_step_over_the_budget_and_in_slices() -> None:
    # The general path (the queue holds more tokens than the budget): the step that runs is priced the same.
    n = node(budget=120, mixed_steps="batched")
    n.slot(0, 2)
    n.queue = [Item("p", 100, pf=True), Item("d", 1, pf=False, pos=50), Item("q", 100, pf=True)]
    assert n.form_batch(0.0) == pytest.approx(2 * _batched(100, 1, 51), rel=1e-12)
    assert sessions(n.batch) == ["p", "d"] and sessions(n.queue) == ["q"]
    # Partial inference: layers 0-1 run the prompt alone, layers 2-3 run the prompt and the decode together.
    m = node(0, 4, mixed_steps="batched")
    full, tail = m.slot(0, 4), m.slot(2, 4)
    m.queue = [Item("p", 100, pf=True, seg={0: full}), Item("d", 1, pf=False, pos=19, seg={0: tail})]
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
    n.queue = [Item("full", 1, pf=False, pos=9, seg={0: full}), Item("tail", 1, pf=False, pos=19, seg={0: tail})]
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
    a = Item("a", 40, pf=True, kv_blocks=3)
    b = Item("b", 20, pf=True, kv_blocks=2)
    c = Item("c", 1, pf=False, pos=5)
    d = Item("d", 10, pf=True, kv_blocks=1)  # would fit, but first come, first admitted
    n.queue = [a, b, c, d]
    assert n.form_batch(0.0) > 0
    assert sessions(n.batch) == ["a", "c"] and sessions(n.queue) == ["b", "d"]
    assert n.kv_used == 3 and n.kv_waits == 2
    n.batch = None
    assert n.form_batch(1.0) == -1.0  # nothing can run: both prompts still blocked
    assert n.batch is None and sessions(n.queue) == ["b", "d"]
    n.kv_change(5.0, -3)  # a's Release
    assert n.form_batch(5.0) > 0
    assert sessions(n.batch) == ["b", "d"] and n.kv_used == 3
    assert b.kv_wait == 5.0 and n.kv_wait_s == 10.0


def test_a_node_without_kv_in_use_admits_any_prompt() -> None:
    n = node(kv_tokens=64)
    n.queue = [Item("big", 500, pf=True, kv_blocks=32)]
    assert n.form_batch(0.0) > 0
    assert n.kv_used == 32 and n.kv_peak == 32 > n.kv_capacity


def test_later_prompt_chunks_need_no_admission() -> None:
    n = node(kv_tokens=16)
    n.kv_used = 1
    n.queue = [Item("second chunk", 100, pf=True, pos=512, kv_blocks=50)]
    assert n.form_batch(0.0) > 0 and n.kv_used == 1


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


class _FakeEngine:
    def __init__(self, budget: int) -> None:
        self.engine_config = EngineConfig(max_batch_tokens=budget)

    def kv_usage(self) -> KVUsage:
        return KVUsage(block_size=16, total_blocks=1, used_blocks=0, free_blocks=1, sessions=0, tokens=0)


async def _runtime_batches(budget: int, items: list[tuple[str, int]]) -> list[list[str]]:
    async def nothing(*args: Any) -> None:
        return None

    loop = BatchLoop(_FakeEngine(budget), deliver=nothing, fail=nothing)  # type: ignore[arg-type]
    for session, n in items:
        await loop.submit(Work(StepItem(SessionId(session), 0, token_ids=[1] * n)))
    out = []
    while loop.queued_tokens or loop._deferred:
        batch = await loop._next_batch()
        out.append([str(w.item.session) for w in batch])
    return out


def _sim_batches(budget: int, items: list[tuple[str, int]]) -> list[list[str]]:
    n = node(budget=budget)
    n.queue = [Item(s, k, pf=k > 1, pos=7) for s, k in items]  # pos > 0: no KV admission in the way
    out = []
    while n.queue:
        assert n.form_batch(0.0) >= 0
        out.append(sessions(n.batch))
        n.batch = None
    return out


@pytest.mark.parametrize("budget, items", [
    (100, [("p60", 60), ("d1", 1), ("p50", 50), ("d2", 1), ("p38", 38), ("d3", 1)]),
    (10, [("d1", 1), ("big", 30), ("d2", 1), ("p9", 9), ("d3", 1)]),  # an oversized item runs alone, first
    (3, [(f"d{i}", 1) for i in range(8)]),  # decode items over the budget
    (8192, [("p512", 512), *((f"d{i}", 1) for i in range(50)), ("p300", 300)]),
])
async def test_batches_mirror_the_runtime_batch_loop(budget: int, items: list[tuple[str, int]]) -> None:
    assert _sim_batches(budget, items) == await _runtime_batches(budget, items)


def test_sim_item_stand_in_has_the_fields_a_node_reads() -> None:
    from hetnode.testnet.sim.coordinator import SimRequest

    fields = set(Item.__slots__) - {"session"}
    assert fields <= set(SimRequest.__slots__)
