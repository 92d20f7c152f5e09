"""Reservations of KV that wait for room instead of failing: ThunderServe's KV queues on the decode side.

A hand-off booked when it starts (the phase-split schedulers' decode_booking "handoff") asks each decode hop to
reserve the KV it will be handed; a hop without room makes the reservation wait, never refuses it. Waiting
reservations are granted first come, first granted: one that arrives while others wait queues behind them even
if it would fit, and after each release the head is granted while it fits (so a large reservation is not passed
over for ever by small ones). Both executors run this one object over their ledger: a node's batch loop
(`BatchLoop.reserve_queued`) and the simulator's decode hops (`testnet/sim/handoff.py`).

Pure: the executor says when KV was released and which waiting reservations are gone; keys are its own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

from hetnode.policy.kv_ledger import KVLedger

K = TypeVar("K", bound=Hashable)


class ReservationQueue(Generic[K]):
    """The waiting reservations of one ledger: (key, session, tokens), in arrival order."""

    __slots__ = ("_waiting", "waited")

    def __init__(self) -> None:
        self._waiting: deque[tuple[K, Hashable, int]] = deque()
        self.waited = 0  # reservations that had to wait

    def __len__(self) -> int:
        return len(self._waiting)

    def request(self, ledger: KVLedger, key: K, session: Hashable, tokens: int) -> bool:
        """Reserve `tokens` for `session` now if nothing waits ahead of it and the ledger has room (True); else it
        waits (False), to come out of `grant` once it is at the head and fits."""
        if not self._waiting and ledger.reserve(session, tokens):
            return True
        self.waited += 1
        self._waiting.append((key, session, tokens))
        return False

    def grant(self, ledger: KVLedger, gone: Callable[[K], bool] = lambda key: False) -> list[K]:
        """After KV was released: the keys of the waiting reservations now reserved in the ledger, in order (the
        head while it fits; those `gone` says ended meanwhile are dropped unreserved)."""
        granted = []
        while self._waiting:
            key, session, tokens = self._waiting[0]
            if gone(key):
                self._waiting.popleft()
                continue
            if not ledger.reserve(session, tokens):
                break
            self._waiting.popleft()
            granted.append(key)
        return granted

    def drop(self, key: K) -> bool:
        """Give up a waiting reservation (its session ended); whether it was waiting."""
        before = len(self._waiting)
        self._waiting = deque(w for w in self._waiting if w[0] != key)
        return len(self._waiting) < before

    def clear(self) -> list[K]:
        """Give up every waiting reservation (the executor stops); their keys."""
        keys = [key for key, _, _ in self._waiting]
        self._waiting.clear()
        return keys
