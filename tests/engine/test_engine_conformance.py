"""The contract every `Engine` implementation keeps (the networking layer relies on each of these).

Parametrized over implementations: a new backend (vLLM on CUDA, say) adds its factory to ENGINES.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_helpers import sessions

from hetnode.ids import SessionId
from hetnode.kv import KVCacheFull
from hetnode.node.engine import Engine, EngineConfig, EngineError, SamplingParams, StepItem, TorchEngine

Factory = Callable[[Path, int, int, EngineConfig], Engine]
ENGINES: dict[str, Factory] = {
    "torch": lambda path, first, last, cfg: TorchEngine.load(path, first, last, engine_config=cfg),
}
SMALL = EngineConfig(num_kv_blocks=8, block_size=4)
A, B = SessionId("a"), SessionId("b")
GREEDY_STOP = SamplingParams(stop_token_ids=(2,))


@pytest.fixture(params=sorted(ENGINES))
def make(request: pytest.FixtureRequest, tiny_llama: Path) -> Callable[..., Engine]:
    factory = ENGINES[request.param]

    def build(first: int = 0, last: int = 5, config: EngineConfig = SMALL) -> Engine:
        return factory(tiny_llama, first, last, config)

    return build


def test_stage_roles_follow_the_layer_range(make: Callable[..., Engine]) -> None:
    first, middle, last = make(0, 2), make(2, 4), make(4, 5)
    assert (first.is_first, first.is_last) == (True, False)
    assert (middle.is_first, middle.is_last) == (False, False)
    assert (last.is_first, last.is_last) == (False, True)


def test_first_stage_returns_hidden_states_per_item(make: Callable[..., Engine]) -> None:
    engine = make(0, 2)
    results = engine.step([StepItem(A, 0, token_ids=[5, 6, 7]), StepItem(B, 0, token_ids=[9])])
    assert [r.session for r in results] == [A, B]
    assert [tuple(r.hidden.shape) for r in results if r.hidden is not None] == [(3, 72), (1, 72)]
    assert all(r.token is None for r in results)


def test_last_stage_samples_only_items_that_ask(make: Callable[..., Engine]) -> None:
    first, last = make(0, 3), make(3, 5)
    items = [StepItem(A, 0, token_ids=[5, 6]), StepItem(B, 0, token_ids=[7, 8], sampling=GREEDY_STOP)]
    hidden = first.step(items)
    results = last.step(
        [StepItem(i.session, 0, hidden=h.hidden, sampling=i.sampling) for i, h in zip(items, hidden, strict=True)]
    )
    assert results[0].token is None and results[0].hidden is None
    assert isinstance(results[1].token, int)


def test_malformed_steps_are_refused_without_touching_kv(make: Callable[..., Engine]) -> None:
    first, later = make(0, 2), make(2, 5)
    bad_first = [
        [],
        [StepItem(A, 0, hidden=torch.zeros(1, 72))],
        [StepItem(A, 0, token_ids=[1]), StepItem(A, 1, token_ids=[2])],
        [StepItem(A, 0, token_ids=[100_000])],
        [StepItem(A, 3, token_ids=[1])],  # a gap: positions 0-2 never reached this stage
        [StepItem(A, 0, token_ids=[])],
    ]
    for items in bad_first:
        with pytest.raises(EngineError):
            first.step(items)
    for items in ([StepItem(A, 0, token_ids=[1])], [StepItem(A, 0, hidden=torch.zeros(2, 71))]):
        with pytest.raises(EngineError):
            later.step(items)
    assert first.kv_usage().used_blocks == later.kv_usage().used_blocks == 0


def test_too_many_tokens_for_one_step(make: Callable[..., Engine]) -> None:
    engine = make(config=EngineConfig(num_kv_blocks=8, block_size=4, max_batch_tokens=4))
    with pytest.raises(EngineError, match="max_batch_tokens"):
        engine.step([StepItem(A, 0, token_ids=[1, 2, 3]), StepItem(B, 0, token_ids=[4, 5])])


def test_kv_full_is_all_or_nothing_and_release_frees_it(make: Callable[..., Engine]) -> None:
    engine = make()  # 8 blocks of 4 tokens
    engine.step([StepItem(A, 0, token_ids=list(range(10, 30)))])  # 5 blocks
    before = engine.kv_usage()
    items = [StepItem(A, 20, token_ids=[3]), StepItem(B, 0, token_ids=list(range(10, 23)))]  # 1 + 4 blocks
    assert engine.blocks_needed(items) == 5
    with pytest.raises(KVCacheFull):
        engine.step(items)
    assert engine.kv_usage() == before
    assert engine.release(A) == 5
    assert engine.release(A) == 0  # idempotent
    engine.step(items[1:])
    assert engine.kv_usage().used_blocks == 4


def test_failed_step_rolls_kv_back(make: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = make()
    engine.step([StepItem(A, 0, token_ids=[5, 6, 7])])
    before = engine.kv_usage()
    if not isinstance(engine, TorchEngine):
        pytest.skip("fault injection reaches into the torch backend")

    def boom(*args: object) -> torch.Tensor:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.stack, "forward", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step([StepItem(A, 3, token_ids=[8, 9, 10, 11, 12]), StepItem(B, 0, token_ids=[1])])
    assert engine.kv_usage() == before


def test_rewinding_a_session_recomputes_from_that_position(make: Callable[..., Engine]) -> None:
    engine = make()
    params = SamplingParams(return_logits=True)
    engine.step([StepItem(A, 0, token_ids=[5, 6, 7])])
    engine.step([StepItem(A, 3, token_ids=[99], sampling=params)])  # a token the caller then takes back
    rewound = engine.step([StepItem(A, 3, token_ids=[8], sampling=params)])[0]
    fresh = engine.step([StepItem(B, 0, token_ids=[5, 6, 7, 8], sampling=params)])[0]
    assert rewound.logits is not None and fresh.logits is not None
    torch.testing.assert_close(rewound.logits, fresh.logits, atol=1e-4, rtol=0)
    assert engine.kv_usage().tokens == 8


def test_close_releases_everything(make: Callable[..., Engine]) -> None:
    engine = make()
    engine.step([StepItem(s, 0, token_ids=[1, 2, 3, 4, 5]) for s in sessions(3)])
    assert engine.kv_usage().used_blocks == 6
    engine.close()
    assert engine.kv_usage().used_blocks == 0 and engine.kv_usage().sessions == 0


def _kv_state(engine: Engine) -> tuple[object, ...]:
    """Everything a failed step must leave as it found it: usage, and (where visible) each session's table."""
    tables = (
        {lease.session: (lease.num_tokens, lease.blocks) for lease in engine.pool}
        if isinstance(engine, TorchEngine)
        else {}
    )
    return engine.kv_usage(), tables


def _continue(engine: Engine, items: list[StepItem]) -> list[torch.Tensor]:
    results = engine.step(items)
    return [r.logits for r in results if r.logits is not None]


def test_rewind_step_refused_for_kv_full_keeps_the_rewound_tokens(make: Callable[..., Engine]) -> None:
    engine, never_tried = make(), make()  # 8 blocks of 4 tokens
    for e in (engine, never_tried):
        e.step([StepItem(A, 0, token_ids=list(range(10, 19))), StepItem(B, 0, token_ids=list(range(30, 46)))])
    before = _kv_state(engine)  # A: 9 tokens in 3 blocks, B: 16 in 4, 1 block free
    # A rewinds to 4 and B to 0, giving back 4 blocks between them, but only once the step succeeds; the new
    # session needs 3 blocks now, and there is 1.
    with pytest.raises(KVCacheFull):
        engine.step(
            [
                StepItem(A, 4, token_ids=[7]),
                StepItem(SessionId("c"), 0, token_ids=list(range(50, 62))),
                StepItem(B, 0, token_ids=[1, 2]),
            ]
        )
    assert _kv_state(engine) == before
    params = SamplingParams(return_logits=True)
    after = [StepItem(A, 9, token_ids=[19], sampling=params), StepItem(B, 16, token_ids=[46], sampling=params)]
    for got, want in zip(_continue(engine, after), _continue(never_tried, after), strict=True):
        torch.testing.assert_close(got, want)


def test_step_failing_in_the_forward_pass_changes_no_session(
    make: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, never_tried = make(), make()
    for e in (engine, never_tried):
        e.step([StepItem(A, 0, token_ids=list(range(10, 19))), StepItem(B, 0, token_ids=[5, 6, 7, 8, 9])])
    before = _kv_state(engine)
    if not isinstance(engine, TorchEngine):
        pytest.skip("fault injection reaches into the torch backend")

    def boom(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("device lost")

    # The last layer's MLP fails after every layer has written the step's keys and values: over A's tokens
    # 4-8 (a rewind), past B's end (an append) and into C's fresh blocks.
    monkeypatch.setattr(engine.stack.layers[-1], "down", boom)
    failing = [
        StepItem(B, 5, token_ids=[1]),
        StepItem(A, 4, token_ids=[20, 21, 22, 23, 24, 25]),
        StepItem(SessionId("c"), 0, token_ids=[1, 2, 3, 4, 5]),
    ]
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step(failing)
    monkeypatch.undo()
    assert _kv_state(engine) == before
    params = SamplingParams(return_logits=True)
    after = [StepItem(A, 9, token_ids=[19], sampling=params), StepItem(B, 5, token_ids=[10], sampling=params)]
    for got, want in zip(_continue(engine, after), _continue(never_tried, after), strict=True):
        torch.testing.assert_close(got, want)


def test_blocks_taken_by_a_failed_step_are_returned(
    make: Callable[..., Engine], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make()  # 8 blocks of 4 tokens
    engine.step([StepItem(A, 0, token_ids=list(range(10, 18))), StepItem(B, 0, token_ids=list(range(30, 46)))])
    before = _kv_state(engine)  # A: 8 tokens in 2 blocks, B: 16 in 4, 2 blocks free
    # A's next token needs a block, the new session two; B's rewind frees three, but only after the step.
    with pytest.raises(KVCacheFull):
        engine.step(
            [
                StepItem(A, 8, token_ids=[1]),
                StepItem(SessionId("c"), 0, token_ids=list(range(50, 58))),
                StepItem(B, 0, token_ids=[1, 2]),
            ]
        )
    assert _kv_state(engine) == before
    if not isinstance(engine, TorchEngine):
        return

    def boom(x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.stack.layers[0], "down", boom)
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step([StepItem(A, 8, token_ids=[1]), StepItem(B, 14, token_ids=[1, 2, 3, 4, 5, 6])])
    assert _kv_state(engine) == before
    assert engine.kv_usage().free_blocks == 2
