"""KV leaves one engine and enters another: a decode continued from imported KV equals one that never moved.

The engines may cut the model differently (a whole model hands its KV to two shards, and two shards to a whole
model): each layer's keys and values go to the engine that holds that layer. They may go after the step (whole)
or from inside it, each layer as soon as the step has computed it (layer-wise, through the step's hook).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from hetnode.ids import SessionId
from hetnode.kv import KVCacheFull
from hetnode.node.engine import EngineConfig, EngineError, SamplingParams, StepItem, TorchEngine

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]
GREEDY = SamplingParams()
S = SessionId("s")


def engines(path: Path, cuts: Sequence[int], blocks: int = 64) -> list[TorchEngine]:
    return [TorchEngine.load(path, a, b, engine_config=EngineConfig(num_kv_blocks=blocks, block_size=4))
            for a, b in itertools.pairwise(cuts)]


def run(stages: Sequence[TorchEngine], start: int, ids: list[int]) -> int:
    """One item through a chain of engines; the sampled token."""
    item = StepItem(S, start, token_ids=ids, sampling=GREEDY if stages[-1].is_last else None)
    for i, e in enumerate(stages):
        last = i == len(stages) - 1
        [res] = e.step([StepItem(S, start, token_ids=item.token_ids, hidden=item.hidden,
                                 sampling=GREEDY if last else None)])
        item = StepItem(S, start, hidden=res.hidden)
    assert res.token is not None
    return res.token


def decode(stages: Sequence[TorchEngine], first: int, n: int) -> list[int]:
    out = [first]
    for i in range(n):
        out.append(run(stages, len(PROMPT) + i, [out[-1]]))
    return out


def run_streaming(stages: Sequence[TorchEngine], dst: Sequence[TorchEngine], ids: list[int]) -> int:
    """A prefill through `stages` that hands each layer's KV to `dst` from inside the step, layer by layer."""
    for d in dst:
        d.reserve_kv(S, len(ids))
    item = StepItem(S, 0, token_ids=ids)
    for i, e in enumerate(stages):

        def layer_done(layer: int, e: TorchEngine = e) -> None:
            keys, values = e.export_kv(S, 0, len(ids), layers=(layer, layer + 1))
            [d] = [d for d in dst if d.first_layer <= layer < d.last_layer]
            d.import_kv(S, 0, layer, keys, values)

        [res] = e.step([StepItem(S, 0, token_ids=item.token_ids, hidden=item.hidden,
                                 sampling=GREEDY if i == len(stages) - 1 else None)], layer_done)
        item = StepItem(S, 0, hidden=res.hidden)
    assert res.token is not None
    return res.token


def hand_over(src: Sequence[TorchEngine], dst: Sequence[TorchEngine], end: int) -> None:
    """Every layer's KV of positions [0, end), from the engine that computed it to the one that holds it."""
    for d in dst:
        d.reserve_kv(S, end)
    for s in src:
        keys, values = s.export_kv(S, 0, end)
        for d in dst:
            lo, hi = max(s.first_layer, d.first_layer), min(s.last_layer, d.last_layer)
            if lo < hi:
                part = slice(lo - s.first_layer, hi - s.first_layer)
                d.import_kv(S, 0, lo, keys[part], values[part])


@pytest.mark.parametrize("src_cuts, dst_cuts", [([0, 5], [0, 2, 5]), ([0, 3, 5], [0, 5]), ([0, 1, 5], [0, 4, 5])])
def test_decode_from_imported_kv_equals_decode_where_it_was_computed(
        tiny_dir: Callable[..., Path], src_cuts: list[int], dst_cuts: list[int]) -> None:
    path = tiny_dir("llama")
    src, dst = engines(path, src_cuts), engines(path, dst_cuts)
    first = run(src, 0, PROMPT)
    hand_over(src, dst, len(PROMPT))
    assert decode(dst, first, 8) == decode(src, first, 8)


@pytest.mark.parametrize("src_cuts, dst_cuts", [([0, 5], [0, 2, 5]), ([0, 3, 5], [0, 5])])
def test_decode_from_kv_streamed_layer_by_layer_equals_decode_where_it_was_computed(
        tiny_dir: Callable[..., Path], src_cuts: list[int], dst_cuts: list[int]) -> None:
    path = tiny_dir("llama")
    src, dst, ref = engines(path, src_cuts), engines(path, dst_cuts), engines(path, [0, 5])
    first = run_streaming(src, dst, PROMPT)
    assert first == run(ref, 0, PROMPT)
    assert decode(dst, first, 8) == decode(ref, first, 8)


def test_the_layer_hook_sees_each_layer_once_computed_and_before_the_next(tiny_dir: Callable[..., Path]) -> None:
    [e] = engines(tiny_dir("llama"), [1, 4])
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    hidden = torch.randn(len(PROMPT), e.config.hidden_size)

    def layer_done(layer: int) -> None:
        keys, _ = e.export_kv(S, 0, len(PROMPT))  # every layer here, mid-step
        seen.append((layer, keys[layer - 1].clone(), keys[layer:].clone()))

    e.step([StepItem(S, 0, hidden=hidden)], layer_done)
    assert [layer for layer, _, _ in seen] == [1, 2, 3]
    after, _ = e.export_kv(S, 0, len(PROMPT))
    for layer, done, later in seen:
        assert torch.equal(done, after[layer - 1])  # final as soon as its layer ran
        assert not later.any()  # the layers after it were not computed yet (fresh blocks are zeros)
    keys, values = e.export_kv(S, 2, 7, layers=(2, 4))
    assert keys.shape == values.shape == (2, 5, e.config.num_kv_heads, e.config.head_dim)
    assert torch.equal(keys, after[1:3, 2:7])
    for layers in [(0, 2), (2, 2), (3, 5)]:
        with pytest.raises(EngineError, match="layers"):
            e.export_kv(S, 0, 1, layers=layers)


def test_a_hook_that_raises_fails_the_step_and_changes_no_kv(tiny_dir: Callable[..., Path]) -> None:
    [e] = engines(tiny_dir("llama"), [0, 5])
    run([e], 0, PROMPT[:4])
    before = e.export_kv(S, 0, 4)[0]

    def layer_done(layer: int) -> None:
        if layer == 2:
            raise RuntimeError("the hook failed")

    with pytest.raises(RuntimeError, match="hook"):
        e.step([StepItem(S, 4, token_ids=PROMPT[4:])], layer_done)
    assert e.pool.lease(S).num_tokens == 4 and torch.equal(e.export_kv(S, 0, 4)[0], before)
    assert run([e], 4, PROMPT[4:]) == run(engines(tiny_dir("llama"), [0, 5]), 0, PROMPT)


def test_export_is_a_copy_of_exactly_the_positions_asked(tiny_dir: Callable[..., Path]) -> None:
    [e] = engines(tiny_dir("llama"), [0, 5])
    run([e], 0, PROMPT)
    keys, values = e.export_kv(S, 2, 7)
    cfg = e.config
    assert keys.shape == values.shape == (5, 5, cfg.num_kv_heads, cfg.head_dim)
    whole, _ = e.export_kv(S, 0, len(PROMPT))
    assert torch.equal(keys, whole[:, 2:7])
    keys.zero_()  # a copy: the cache is untouched
    assert torch.equal(e.export_kv(S, 2, 7)[0], whole[:, 2:7])


def test_kv_hand_off_refuses_what_is_out_of_place(tiny_dir: Callable[..., Path]) -> None:
    path = tiny_dir("llama")
    [src] = engines(path, [0, 5])
    [dst] = engines(path, [0, 2])
    run([src], 0, PROMPT)
    keys, values = src.export_kv(S, 0, len(PROMPT))
    with pytest.raises(EngineError, match="holds no KV"):
        dst.import_kv(S, 0, 0, keys[:2], values[:2])  # nothing reserved
    with pytest.raises(EngineError, match="holds no KV"):
        dst.export_kv(S, 0, 1)
    dst.reserve_kv(S, len(PROMPT))
    with pytest.raises(EngineError, match="already holds"):
        dst.reserve_kv(S, 4)
    with pytest.raises(EngineError, match="layers"):
        dst.import_kv(S, 0, 1, keys[1:3], values[1:3])  # layer 2 is not here
    with pytest.raises(EngineError, match="positions"):
        dst.import_kv(S, 5, 0, keys[:2], values[:2])  # past the reserved tokens
    with pytest.raises(EngineError, match="shapes"):
        dst.import_kv(S, 0, 0, keys[:2, :, :1], values[:2, :, :1])
    before = dst.export_kv(S, 0, len(PROMPT))[0]
    assert torch.equal(before, torch.zeros_like(before))  # none of the refused imports wrote anything
    dst.import_kv(S, 0, 0, keys[:2], values[:2])
    assert torch.equal(dst.export_kv(S, 0, len(PROMPT))[0], keys[:2])


def test_a_reservation_is_all_or_nothing(tiny_dir: Callable[..., Path]) -> None:
    [e] = engines(tiny_dir("llama"), [0, 5], blocks=2)  # 8 tokens of 4-token blocks
    with pytest.raises(KVCacheFull):
        e.reserve_kv(S, 9)
    assert e.kv_usage().used_blocks == 0 and S not in e.pool
    e.reserve_kv(S, 8)
    assert e.kv_usage().used_blocks == 2
    assert e.release(S) == 2
