"""BlockAllocator: reference counts, the free list, and the errors a caller sees."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hetnode.errors import HetnodeError
from hetnode.kv import BlockAllocator, BlockId, KVCacheFull, blocks_for_tokens


def test_fresh_allocator_hands_out_low_ids_first() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=16)
    assert alloc.allocate(3) == [0, 1, 2]
    assert (alloc.num_used, alloc.num_free) == (3, 1)


def test_out_of_blocks_is_all_or_nothing_with_a_clear_message() -> None:
    alloc = BlockAllocator(num_blocks=4, block_size=8)
    alloc.allocate(3)
    with pytest.raises(KVCacheFull, match=r"need 2 more blocks \(16 tokens\), 1 free") as info:
        alloc.allocate(2)
    assert isinstance(info.value, HetnodeError)
    assert (info.value.needed, info.value.free) == (2, 1)
    assert alloc.num_free == 1


def test_retained_block_returns_to_the_free_list_only_after_last_holder() -> None:
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    [block] = alloc.allocate(1)
    alloc.retain(block)
    assert alloc.refcount(block) == 2
    alloc.free([block])
    assert alloc.num_free == 1
    alloc.free([block])
    assert alloc.num_free == 2
    assert alloc.refcount(block) == 0


def test_double_free_and_bad_ids_are_refused() -> None:
    alloc = BlockAllocator(num_blocks=2, block_size=4)
    [block] = alloc.allocate(1)
    alloc.free([block])
    with pytest.raises(ValueError, match="double free"):
        alloc.free([block])
    with pytest.raises(ValueError, match="out of range"):
        alloc.retain(BlockId(7))
    with pytest.raises(ValueError):
        BlockAllocator(num_blocks=0, block_size=4)


@pytest.mark.parametrize(("tokens", "blocks"), [(0, 0), (1, 1), (16, 1), (17, 2), (32, 2)])
def test_blocks_for_tokens(tokens: int, blocks: int) -> None:
    assert blocks_for_tokens(tokens, 16) == blocks


@given(st.lists(st.tuples(st.sampled_from(["alloc", "retain", "free"]), st.integers(0, 5)), max_size=60))
def test_random_operations_never_leak_or_hand_out_a_used_block(ops: list[tuple[str, int]]) -> None:
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    holders: list[BlockId] = []  # one entry per reference held
    for op, arg in ops:
        if op == "alloc":
            if arg > alloc.num_free:
                with pytest.raises(KVCacheFull):
                    alloc.allocate(arg)
                continue
            fresh = alloc.allocate(arg)
            assert not set(fresh) & set(holders), "a block in use was handed out again"
            holders.extend(fresh)
        elif holders and op == "retain":
            block = holders[arg % len(holders)]
            alloc.retain(block)
            holders.append(block)
        elif holders:
            block = holders.pop(arg % len(holders))
            alloc.free([block])
        assert alloc.num_used == len(set(holders))
        assert all(alloc.refcount(b) == holders.count(b) for b in set(holders))
    alloc.free(holders)
    assert alloc.num_free == alloc.num_blocks
