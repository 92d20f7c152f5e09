"""KV reservations on one node, in blocks: who may hold how much of the pool, before any tensor is touched.

The ledger is the batch policy's view of KV memory. It counts blocks the way the runtime's paged pool counts them
(`hetnode.kv.blocks.blocks_for_tokens`: a session holding t tokens occupies ceil(t / block_size) blocks) but
holds no block ids: a reservation is a promise that the engine's allocations for that session will fit. As
long as every step the engine runs stays inside the reservations, `KVCacheFull` cannot happen, which is what
lets the batch loop queue work that does not fit instead of failing it mid-step.

Sessions are kept in admission order, so the policy can preempt the youngest (the one that has had the least
work done, and whose restart elsewhere costs least). Integers only: no clock, no I/O, no engine.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable


class KVLedger:
    """`capacity` blocks of `block_size` tokens, reserved per session."""

    __slots__ = ("_age", "_next_age", "block_size", "capacity", "limit", "used")

    def __init__(self, capacity: int, block_size: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0 blocks, got {capacity}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.capacity = capacity
        self.block_size = block_size
        self.used = 0  # blocks reserved by all sessions together
        # session -> tokens its blocks hold (blocks x block_size), in admission order. Public, read-only outside:
        # the batch policy reads it directly in its per-item loop (a dict lookup, not a method call).
        self.limit: dict[Hashable, int] = {}
        self._age: dict[Hashable, int] = {}  # session -> admission sequence number
        self._next_age = 0

    @property
    def free(self) -> int:
        """Blocks nobody has reserved (negative while an overcommitted admission is in the pool)."""
        return self.capacity - self.used

    def blocks_for(self, tokens: int) -> int:
        """Blocks that hold `tokens` tokens."""
        return -(-tokens // self.block_size)

    def __contains__(self, session: Hashable) -> bool:
        return session in self.limit

    def __len__(self) -> int:
        return len(self.limit)

    def held(self, session: Hashable) -> int:
        """Blocks reserved for `session` (0 for a session the ledger does not hold)."""
        return self.limit.get(session, 0) // self.block_size

    def reserve(self, session: Hashable, tokens: int, *, overcommit: bool = False) -> bool:
        """Make `session`'s reservation cover its first `tokens` tokens: admits a new session, grows a held one.

        All or nothing: False (and no change) when the blocks it lacks are not free. `overcommit` takes them
        anyway; the policy uses it only for a prompt larger than the whole pool on a node that holds nothing,
        and only when asked to (`BatchConfig.admit_oversized`).
        """
        size = self.block_size
        limit = self.limit.get(session)
        need = -(-tokens // size) - (limit or 0) // size
        if need > self.capacity - self.used and not overcommit:
            return False
        if limit is None:
            self._age[session] = self._next_age
            self._next_age += 1
            self.limit[session] = limit = 0
        if need > 0:
            self.limit[session] = limit + need * size
            self.used += need
        return True

    def release(self, session: Hashable) -> int:
        """Drop `session`'s reservation; returns how many blocks it held (0 when it held none)."""
        limit = self.limit.pop(session, None)
        if limit is None:
            return 0
        del self._age[session]
        held = limit // self.block_size
        self.used -= held
        return held

    def youngest(self, sessions: Iterable[Hashable]) -> Hashable:
        """The most recently admitted of `sessions` (each of which the ledger holds)."""
        return max(sessions, key=self._age.__getitem__)

    def sessions(self) -> list[Hashable]:
        """Held sessions, oldest admission first."""
        return list(self.limit)
