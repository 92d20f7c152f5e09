"""The KV ledger: block reservations per session, counted as the paged pool counts blocks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hetnode.kv.blocks import blocks_for_tokens
from hetnode.policy import KVLedger


def test_reserve_grow_release() -> None:
    ledger = KVLedger(4, 16)
    assert ledger.reserve("a", 20) and ledger.held("a") == 2 and ledger.used == 2
    assert ledger.reserve("a", 32) and ledger.held("a") == 2  # still inside its second block
    assert ledger.reserve("a", 33) and ledger.held("a") == 3
    assert ledger.reserve("a", 5) and ledger.held("a") == 3  # a reservation never shrinks
    assert not ledger.reserve("b", 17) and "b" not in ledger and ledger.used == 3  # all or nothing
    assert ledger.reserve("b", 16) and ledger.free == 0
    assert ledger.release("a") == 3 and ledger.release("a") == 0 and ledger.used == 1
    assert ledger.sessions() == ["b"]


def test_overcommit_and_youngest() -> None:
    ledger = KVLedger(2, 16)
    assert ledger.reserve("big", 100, overcommit=True) and ledger.used == 7 and ledger.free == -5
    ledger.reserve("x", 1, overcommit=True)
    ledger.reserve("y", 1, overcommit=True)
    assert ledger.youngest(["x", "big", "y"]) == "y" and ledger.youngest(["big", "x"]) == "x"


@given(st.integers(0, 10_000), st.integers(1, 1024))
def test_block_math_is_the_pools(tokens: int, block_size: int) -> None:
    ledger = KVLedger(1 << 30, block_size)
    assert ledger.blocks_for(tokens) == blocks_for_tokens(tokens, block_size)
    ledger.reserve("s", tokens)
    assert ledger.held("s") == blocks_for_tokens(tokens, block_size)


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 200), st.booleans()), max_size=60))
def test_never_over_capacity_and_release_frees_everything(ops: list[tuple[str, int, bool]]) -> None:
    ledger = KVLedger(10, 16)
    for session, tokens, release in ops:
        if release:
            ledger.release(session)
        else:
            before, free = ledger.held(session), ledger.free
            need = blocks_for_tokens(tokens, 16) - before
            assert ledger.reserve(session, tokens) == (need <= free)
            assert ledger.held(session) == (max(before, before + need) if need <= free else before)
        assert 0 <= ledger.used <= ledger.capacity
        assert ledger.used == sum(ledger.held(s) for s in ledger.sessions())
    for s in ledger.sessions():
        ledger.release(s)
    assert ledger.used == 0 and len(ledger) == 0
