"""SessionKV leases and the KVPool: growth, rewinding, all-or-nothing steps and idempotent release."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetnode.ids import SessionId
from hetnode.kv import KVCacheFull, KVPool, SessionKV, Span

A, B, C = SessionId("a"), SessionId("b"), SessionId("c")


def test_extend_maps_positions_to_slots_through_the_block_table() -> None:
    pool = KVPool(num_blocks=8, block_size=4)
    pool.lease(B).extend(1)  # takes block 0, so A's blocks are not simply 0, 1, ...
    lease = pool.lease(A)
    assert lease.extend(6) == [4, 5, 6, 7, 8, 9]
    assert lease.blocks == (1, 2)
    assert lease.extend(1) == [10]
    assert lease.slot(5) == 9
    assert (lease.num_tokens, lease.capacity) == (7, 8)


def test_truncate_frees_blocks_past_the_new_end() -> None:
    pool = KVPool(num_blocks=8, block_size=4)
    lease = pool.lease(A)
    lease.extend(9)
    lease.truncate(4)
    assert lease.blocks == (0,)
    assert pool.usage().used_blocks == 1
    with pytest.raises(ValueError):
        lease.truncate(5)


def test_release_is_idempotent_on_every_path() -> None:
    pool = KVPool(num_blocks=4, block_size=4)
    with pool.lease(A) as lease:
        lease.extend(5)
    assert lease.released and pool.allocator.num_free == 4
    assert lease.release() == 0
    pool.lease(B).extend(3)
    assert pool.release(B) == 1
    assert pool.release(B) == 0
    assert pool.release(SessionId("never-seen")) == 0
    with pytest.raises(ValueError, match="already released"):
        lease.extend(1)


def test_lease_released_by_context_manager_when_the_body_raises() -> None:
    pool = KVPool(num_blocks=4, block_size=4)
    with pytest.raises(RuntimeError), pool.lease(A) as lease:
        lease.extend(8)
        raise RuntimeError("client went away")
    assert pool.allocator.num_free == 4


def test_grow_is_all_or_nothing() -> None:
    pool = KVPool(num_blocks=4, block_size=4)
    pool.lease(A).extend(4)
    with pytest.raises(KVCacheFull) as info:
        pool.grow([Span(A, 4, 4), Span(B, 0, 9)])  # 1 + 3 blocks, 3 free
    assert info.value.needed == 4
    assert B not in pool
    assert pool.get(A) is not None and pool.get(A).num_tokens == 4  # type: ignore[union-attr]
    assert pool.usage().used_blocks == 1


def test_a_rewind_reuses_its_own_blocks() -> None:
    pool = KVPool(num_blocks=2, block_size=4)
    pool.lease(A).extend(8)
    assert pool.blocks_needed([Span(A, 2, 4)]) == 0
    growth = pool.grow([Span(A, 2, 4)])
    assert growth.slots == [[2, 3, 4, 5]]
    assert growth.overwritten == [2, 3, 4, 5]  # tokens A held there until this step
    assert pool.lease(A).num_tokens == 6


def test_a_rewind_gives_blocks_back_only_when_its_step_commits() -> None:
    pool = KVPool(num_blocks=4, block_size=4)
    pool.lease(A).extend(12)
    with pytest.raises(KVCacheFull):  # A's blocks 1 and 2 are not free while the step may still fail
        pool.grow([Span(A, 0, 1), Span(B, 0, 9)])
    growth = pool.grow([Span(A, 5, 1)])
    assert growth.overwritten == [5]
    assert pool.lease(A).blocks == (0, 1, 2)
    growth.commit()
    assert pool.lease(A).blocks == (0, 1)
    assert pool.usage().free_blocks == 2


def test_rollback_of_a_rewind_keeps_the_rewound_tokens() -> None:
    pool = KVPool(num_blocks=8, block_size=4)
    pool.lease(A).extend(9)
    pool.lease(B).extend(3)
    before = [(lease.session, lease.num_tokens, lease.blocks) for lease in pool]
    growth = pool.grow([Span(A, 2, 1), Span(B, 1, 10), Span(C, 0, 3)])
    growth.rollback()
    growth.rollback()  # a second call (or a commit after it) changes nothing
    growth.commit()
    assert [(lease.session, lease.num_tokens, lease.blocks) for lease in pool] == before
    assert pool.usage().free_blocks == 4


def test_grow_refuses_gaps_and_duplicates() -> None:
    pool = KVPool(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="cannot start at position 3"):
        pool.grow([Span(A, 3, 1)])
    with pytest.raises(ValueError, match="twice"):
        pool.grow([Span(A, 0, 1), Span(A, 1, 1)])


def test_rollback_restores_the_pool() -> None:
    pool = KVPool(num_blocks=8, block_size=4)
    pool.lease(A).extend(3)
    growth = pool.grow([Span(A, 3, 6), Span(B, 0, 5)])
    growth.rollback()
    assert B not in pool
    assert pool.lease(A).num_tokens == 3
    assert pool.usage().used_blocks == 1


def test_usage_snapshot() -> None:
    pool = KVPool(num_blocks=10, block_size=4)
    pool.grow([Span(A, 0, 5), Span(B, 0, 1)])
    usage = pool.usage()
    assert (usage.used_blocks, usage.free_blocks, usage.sessions, usage.tokens) == (3, 7, 2, 6)


_op = st.one_of(
    st.tuples(st.just("grow"), st.lists(st.tuples(st.sampled_from([A, B, C]), st.integers(0, 10)), max_size=3)),
    st.tuples(st.just("rewind"), st.sampled_from([A, B, C]), st.integers(0, 12)),
    st.tuples(st.just("release"), st.sampled_from([A, B, C])),
    st.tuples(st.just("fail"), st.lists(st.tuples(st.sampled_from([A, B, C]), st.integers(1, 6)), max_size=3)),
    st.tuples(
        st.sampled_from(["step", "fail-step"]),
        st.lists(st.tuples(st.sampled_from([A, B, C]), st.integers(0, 12), st.integers(1, 6)), max_size=3),
    ),
)


def _tables(pool: KVPool) -> list[tuple[SessionId, int, tuple[int, ...]]]:
    return [(lease.session, lease.num_tokens, lease.blocks) for lease in pool]


@given(st.lists(_op, max_size=40))
def test_any_sequence_of_steps_returns_every_block(ops: list[tuple]) -> None:  # type: ignore[type-arg]
    pool = KVPool(num_blocks=6, block_size=3)
    for op in ops:
        if op[0] in ("grow", "fail"):
            spans, seen = [], set()
            for session, count in op[1]:
                if session in seen:
                    continue
                seen.add(session)
                lease = pool.get(session)
                spans.append(Span(session, lease.num_tokens if lease else 0, count))
            try:
                growth = pool.grow(spans)
            except KVCacheFull:
                continue
            if op[0] == "fail":  # the step that used the slots raised: its caller rolls back
                growth.rollback()
        elif op[0] in ("step", "fail-step"):  # steps that may rewind: commit, or roll back to what was there
            spans, seen = [], set()
            for session, start, count in op[1]:
                if session not in seen:
                    seen.add(session)
                    lease = pool.get(session)
                    spans.append(Span(session, min(start, lease.num_tokens if lease else 0), count))
            before = _tables(pool)
            try:
                growth = pool.grow(spans)
            except KVCacheFull:
                assert _tables(pool) == before
                continue
            if op[0] == "fail-step":
                growth.rollback()
                assert _tables(pool) == before
            else:
                growth.commit()
        elif op[0] == "rewind" and (lease := pool.get(op[1])) is not None:
            lease.truncate(min(op[2], lease.num_tokens))
        elif op[0] == "release":
            pool.release(op[1])
        usage = pool.usage()
        leases: list[SessionKV] = list(pool)
        held = [b for lease in leases for b in lease.blocks]
        assert len(held) == len(set(held)) == usage.used_blocks, "a block is in two tables or leaked"
        assert all(lease.capacity >= lease.num_tokens > lease.capacity - pool.block_size for lease in leases
                   if lease.num_tokens)
    pool.release_all()
    assert pool.allocator.num_free == pool.allocator.num_blocks
    assert len(pool) == 0
