"""The session cursor: prefill chunks, decode items, and the re-prefill after a move to another pipeline."""

from __future__ import annotations

from hetnode.coordinator.cursor import SessionCursor
from hetnode.coordinator.generation import GenerationParams
from hetnode.ids import SessionId
from hetnode.node.engine import SamplingParams

GREEDY = SamplingParams()


def run_items(cursor: SessionCursor, tokens: list[int]) -> list[tuple[int, list[int], bool]]:
    """Drive the cursor, answering each sampling item with the next of `tokens`; (start, ids, samples) per item."""
    seen = []
    answers = iter(tokens)
    while not cursor.finished:
        item = cursor.next_item()
        assert item.token_ids is not None
        seen.append((item.start, list(item.token_ids), item.sampling is not None))
        cursor.advance(item, next(answers) if item.sampling is not None else None, False)
    return seen


def test_the_whole_prompt_then_one_token_at_a_time() -> None:
    # One item for the context: the batch loop's policy, not the cursor, chunks it under the token budget.
    cursor = SessionCursor(SessionId("a"), [1, 2, 3, 4, 5], GenerationParams(3, GREEDY))
    assert run_items(cursor, [10, 11, 12]) == [(0, [1, 2, 3, 4, 5], True), (5, [10], True), (6, [11], True)]
    assert cursor.generated == [10, 11, 12] and cursor.finish_reason == "length"


def test_restart_re_prefills_prompt_and_generated_tokens_then_decodes_on() -> None:
    cursor = SessionCursor(SessionId("a"), [1, 2, 3], GenerationParams(6, GREEDY))
    for token in (10, 11, 12):
        item = cursor.next_item()
        while item.sampling is None:
            cursor.advance(item, None, False)
            item = cursor.next_item()
        cursor.advance(item, token, False)
    assert cursor.position == 5  # the last token, 12, is not in the KV yet
    cursor.restart(SessionId("b"))
    assert cursor.session == "b"
    # The new pipeline holds nothing: prompt + every generated token in one item, then decode on.
    assert run_items(cursor, [13, 14, 15]) == [(0, [1, 2, 3, 10, 11, 12], True), (6, [13], True), (7, [14], True)]
    assert cursor.generated == [10, 11, 12, 13, 14, 15]


def test_restart_during_the_prompt_starts_the_prompt_over() -> None:
    cursor = SessionCursor(SessionId("a"), list(range(1, 6)), GenerationParams(1, GREEDY))
    cursor.restart(SessionId("b"))
    assert run_items(cursor, [9]) == [(0, [1, 2, 3, 4, 5], True)]
