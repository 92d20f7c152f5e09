"""Paged KV-cache bookkeeping: which fixed-size blocks are free, and how many holders each used block has.

Only integers live here. The tensors that hold keys and values belong to the engine, which indexes them with
the block ids handed out below. Keeping the two apart (as vLLM does) lets the allocator be tested without a
model, and lets KV transfer and quantization speak in the same block ids as the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NewType

from hetnode.errors import HetnodeError

# Index of a block in a stage's KV tensors; slot `block * block_size + offset` holds one token.
BlockId = NewType("BlockId", int)


class KVCacheFull(HetnodeError):
    """Not enough free KV blocks for what was asked; nothing was allocated."""

    def __init__(self, needed: int, free: int, block_size: int) -> None:
        self.needed = needed
        self.free = free
        self.block_size = block_size
        super().__init__(
            f"KV cache full: need {needed} more blocks ({needed * block_size} tokens), {free} free "
            f"(block size {block_size} tokens); release sessions or admit fewer tokens"
        )


def blocks_for_tokens(tokens: int, block_size: int) -> int:
    """How many blocks of `block_size` tokens hold `tokens` tokens."""
    if tokens < 0:
        raise ValueError(f"token count must be >= 0, got {tokens}")
    return -(-tokens // block_size)


class BlockAllocator:
    """A fixed pool of `num_blocks` blocks of `block_size` tokens, with reference counts and a free list.

    A block is free exactly when its reference count is zero. `allocate` hands out blocks with count 1;
    `retain` adds a holder (a prefix shared by two sessions, a block pinned while it streams to another node);
    `free` drops one holder and returns the block to the free list when none is left.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self._block_size = block_size
        self._refcounts = [0] * num_blocks
        # A stack, lowest id on top: the most recently freed block is reused first (still warm in caches),
        # and a fresh allocator hands out 0, 1, 2, ... which keeps tests and logs readable.
        self._free: list[BlockId] = [BlockId(b) for b in range(num_blocks - 1, -1, -1)]

    @property
    def num_blocks(self) -> int:
        return len(self._refcounts)

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._refcounts) - len(self._free)

    def blocks_for_tokens(self, tokens: int) -> int:
        return blocks_for_tokens(tokens, self._block_size)

    def allocate(self, count: int) -> list[BlockId]:
        """`count` fresh blocks with reference count 1, or `KVCacheFull` and no change at all."""
        if count < 0:
            raise ValueError(f"block count must be >= 0, got {count}")
        if count > len(self._free):
            raise KVCacheFull(count, len(self._free), self._block_size)
        taken = [self._free.pop() for _ in range(count)]
        for block in taken:
            self._refcounts[block] = 1
        return taken

    def retain(self, block: BlockId) -> None:
        """Add a holder to a block that is already in use."""
        self._check_used(block)
        self._refcounts[block] += 1

    def free(self, blocks: Iterable[BlockId]) -> None:
        """Drop one holder from each block; a block with no holder left goes back to the free list."""
        for block in blocks:
            self._check_used(block)
            self._refcounts[block] -= 1
            if self._refcounts[block] == 0:
                self._free.append(block)

    def refcount(self, block: BlockId) -> int:
        self._check_id(block)
        return self._refcounts[block]

    def _check_id(self, block: BlockId) -> None:
        if not 0 <= block < len(self._refcounts):
            raise ValueError(f"block id {block} out of range [0, {len(self._refcounts)})")

    def _check_used(self, block: BlockId) -> None:
        self._check_id(block)
        if self._refcounts[block] == 0:
            # A double free would put the block on the free list twice and hand it to two sessions.
            raise ValueError(f"block {block} is not allocated (double free?)")
