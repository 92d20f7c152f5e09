"""Per-session block tables on one stage, and the pool that leases them out.

A session's KV on a stage is a lease: a block table (the blocks that hold its tokens, in order) and a token
count. It grows as prefill chunks and decode tokens arrive, shrinks when a caller rewinds it, and ends with
`release`, which is idempotent so that every exit path (EOS, client gone, error, re-plan) may call it.

A step changes KV all or nothing: `KVPool.grow` reserves room for every session of the step, and the step then
either commits the growth or rolls it back. A rewind gives nothing up before the commit, so a rollback finds
the rewound tokens where they were (the engine restores the values the step overwrote in place).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType

from hetnode.ids import SessionId
from hetnode.kv.blocks import BlockAllocator, BlockId, KVCacheFull


class SessionKV:
    """One session's lease on KV blocks: its block table and how many tokens those blocks hold."""

    def __init__(self, allocator: BlockAllocator, session: SessionId) -> None:
        self.session = session
        self._allocator = allocator
        self._blocks: list[BlockId] = []
        self._num_tokens = 0
        self._released = False

    @property
    def blocks(self) -> tuple[BlockId, ...]:
        """The block table: block i holds positions [i * block_size, (i + 1) * block_size)."""
        return tuple(self._blocks)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def capacity(self) -> int:
        return len(self._blocks) * self._allocator.block_size

    @property
    def released(self) -> bool:
        return self._released

    def blocks_needed(self, total_tokens: int) -> int:
        """Blocks to add so that the table holds `total_tokens` tokens (0 when it already does)."""
        return max(0, self._allocator.blocks_for_tokens(total_tokens) - len(self._blocks))

    def extend(self, count: int) -> list[int]:
        """Make room for `count` more tokens and return their slots; all or nothing (`KVCacheFull`)."""
        return self.overwrite(self._num_tokens, count)

    def overwrite(self, start: int, count: int) -> list[int]:
        """Hold positions [0, start + count), the last `count` of them new, and return the new ones' slots.

        Unlike `truncate` then `extend`, a rewind (start < num_tokens) keeps its blocks: the new tokens go into
        the slots of the ones they replace, and blocks past the new end stay in the table until `trim`, so that
        `restore` can bring the old tokens back. All or nothing (`KVCacheFull`).
        """
        self._check_live()
        if count < 0 or not 0 <= start <= self._num_tokens:
            raise ValueError(f"cannot write {count} tokens at {start} into {self.session}'s {self._num_tokens}")
        end = start + count
        self._blocks.extend(self._allocator.allocate(self.blocks_needed(end)))
        self._num_tokens = end
        return self.slots(start, count)

    def trim(self) -> None:
        """Free the blocks past the ones that hold the session's tokens (left there by `overwrite`)."""
        self.truncate(self._num_tokens)

    def restore(self, num_tokens: int, num_blocks: int) -> None:
        """Undo `overwrite`s: back to `num_tokens` tokens in the first `num_blocks` blocks of the table."""
        self._check_live()
        if not 0 <= num_blocks <= len(self._blocks) or num_tokens > num_blocks * self._allocator.block_size:
            raise ValueError(f"cannot restore {self.session} to {num_tokens} tokens in {num_blocks} blocks")
        self._allocator.free(self._blocks[num_blocks:])
        del self._blocks[num_blocks:]
        self._num_tokens = num_tokens

    def truncate(self, num_tokens: int) -> None:
        """Forget every token at position >= num_tokens, freeing the blocks that no longer hold any."""
        self._check_live()
        if not 0 <= num_tokens <= self._num_tokens:
            raise ValueError(f"cannot truncate {self.session} from {self._num_tokens} to {num_tokens} tokens")
        keep = self._allocator.blocks_for_tokens(num_tokens)
        self._allocator.free(self._blocks[keep:])
        del self._blocks[keep:]
        self._num_tokens = num_tokens

    def slot(self, position: int) -> int:
        """The cache slot (block * block_size + offset) that holds `position`."""
        if not 0 <= position < self.capacity:
            raise IndexError(f"position {position} outside {self.session}'s {self.capacity} reserved slots")
        size = self._allocator.block_size
        return self._blocks[position // size] * size + position % size

    def slots(self, start: int, count: int) -> list[int]:
        size = self._allocator.block_size
        if count and not (start >= 0 and start + count <= self.capacity):
            raise IndexError(f"positions [{start}, {start + count}) outside {self.capacity} reserved slots")
        blocks = self._blocks
        return [blocks[p // size] * size + p % size for p in range(start, start + count)]

    def release(self) -> int:
        """Give every block back; returns how many were held. Calling it again does nothing."""
        if self._released:
            return 0
        self._released = True
        held = len(self._blocks)
        self._allocator.free(self._blocks)
        self._blocks.clear()
        self._num_tokens = 0
        return held

    def __enter__(self) -> SessionKV:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if self._released else f"{self._num_tokens} tokens in {len(self._blocks)} blocks"
        return f"SessionKV({self.session!r}, {state})"

    def _check_live(self) -> None:
        if self._released:
            raise ValueError(f"KV of {self.session} was already released")


@dataclass(frozen=True, slots=True)
class KVUsage:
    """A snapshot of a stage's KV memory, in the units heartbeats and the scheduler speak."""

    block_size: int  # tokens per block
    total_blocks: int
    used_blocks: int
    free_blocks: int
    sessions: int
    tokens: int  # tokens held by all sessions together (<= used_blocks * block_size)


@dataclass(frozen=True, slots=True)
class Span:
    """`count` new tokens of `session` at positions [start, start + count)."""

    session: SessionId
    start: int
    count: int


class Growth:
    """The slots a `KVPool.grow` call handed out; the step that uses them ends with `commit` or `rollback`."""

    def __init__(self, pool: KVPool) -> None:
        self.slots: list[list[int]] = []  # slots[i]: the cache slots of spans[i]'s tokens, in position order
        # Slots of tokens that rewound sessions still hold and the step overwrites: a caller that wants to roll
        # back the values too (not only the bookkeeping) saves them before writing.
        self.overwritten: list[int] = []
        self._pool = pool
        self._created: list[SessionId] = []
        self._before: list[tuple[SessionKV, int, int]] = []  # (lease, num_tokens, num_blocks) before the step
        self._rewound: list[SessionKV] = []
        self._done = False

    def commit(self) -> None:
        """The step succeeded: rewound sessions give back the blocks past their new end."""
        if not self._done:
            self._done = True
            for lease in self._rewound:
                lease.trim()

    def rollback(self) -> None:
        """The step failed: sessions this call created are released, the others hold what they held before."""
        if not self._done:
            self._done = True
            for lease, num_tokens, num_blocks in self._before:
                lease.restore(num_tokens, num_blocks)
            for session in self._created:
                self._pool.release(session)


class KVPool:
    """All KV leases of one stage over one block allocator."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size)
        self._leases: dict[SessionId, SessionKV] = {}

    @property
    def block_size(self) -> int:
        return self.allocator.block_size

    def lease(self, session: SessionId) -> SessionKV:
        """The session's lease, created empty on first use."""
        lease = self._leases.get(session)
        if lease is None:
            lease = self._leases[session] = SessionKV(self.allocator, session)
        return lease

    def get(self, session: SessionId) -> SessionKV | None:
        return self._leases.get(session)

    def __contains__(self, session: object) -> bool:
        return session in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[SessionKV]:
        return iter(list(self._leases.values()))

    def release(self, session: SessionId) -> int:
        """Free the session's blocks and forget it; returns the blocks freed (0 for an unknown session)."""
        lease = self._leases.pop(session, None)
        return lease.release() if lease is not None else 0

    def release_all(self) -> int:
        return sum(self.release(session) for session in list(self._leases))

    def blocks_needed(self, spans: Sequence[Span]) -> int:
        """Free blocks `grow(spans)` takes. A rewind reuses its own blocks, but those past its new end come
        back only when the step commits, so they cannot serve another session of the same step."""
        need = 0
        blocks_for_tokens = self.allocator.blocks_for_tokens
        for span in self._check(spans):
            lease = self._leases.get(span.session)
            held = lease.num_blocks if lease is not None else 0
            need += max(0, blocks_for_tokens(span.start + span.count) - held)
        return need

    def grow(self, spans: Sequence[Span]) -> Growth:
        """Reserve room for every span at once; a span that starts before its session's end rewinds it.

        All or nothing: `KVCacheFull` (or `ValueError` for a malformed span) leaves the pool unchanged, and so
        does `rollback` on the returned growth.
        """
        need = self.blocks_needed(spans)
        if need > self.allocator.num_free:
            raise KVCacheFull(need, self.allocator.num_free, self.block_size)
        growth = Growth(self)
        try:
            for span in spans:
                lease = self._leases.get(span.session)
                if lease is None:
                    lease = self.lease(span.session)
                    growth._created.append(span.session)
                else:
                    held = lease.num_tokens
                    growth._before.append((lease, held, lease.num_blocks))
                    if span.start < held:
                        growth._rewound.append(lease)
                        growth.overwritten += lease.slots(span.start, min(held, span.start + span.count) - span.start)
                growth.slots.append(lease.overwrite(span.start, span.count))
        except BaseException:
            growth.rollback()
            raise
        return growth

    def usage(self) -> KVUsage:
        return KVUsage(
            block_size=self.block_size,
            total_blocks=self.allocator.num_blocks,
            used_blocks=self.allocator.num_used,
            free_blocks=self.allocator.num_free,
            sessions=len(self._leases),
            tokens=sum(lease.num_tokens for lease in self._leases.values()),
        )

    def _check(self, spans: Sequence[Span]) -> Sequence[Span]:
        seen: set[SessionId] = set()
        for span in spans:
            if span.session in seen:
                raise ValueError(f"session {span.session} appears twice in one step")
            seen.add(span.session)
            if span.count < 0 or span.start < 0:
                raise ValueError(f"bad span for {span.session}: start {span.start}, count {span.count}")
            lease = self._leases.get(span.session)
            held = lease.num_tokens if lease is not None else 0
            if span.start > held:
                raise ValueError(
                    f"session {span.session} holds {held} tokens on this stage; a span cannot start at "
                    f"position {span.start} (every earlier position must pass through this stage first)"
                )
        return spans
