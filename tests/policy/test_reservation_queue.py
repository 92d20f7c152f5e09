"""KV reservations that wait for room (ThunderServe's KV queues), first come first granted: the queue a node's
batch loop and the simulator's decode hops both run."""

from __future__ import annotations

from hetnode.policy.kv_ledger import KVLedger
from hetnode.policy.reservation_queue import ReservationQueue


def test_a_reservation_waits_behind_those_that_wait_already_even_when_it_fits() -> None:
    ledger = KVLedger(capacity=10, block_size=10)  # 100 tokens
    q: ReservationQueue[str] = ReservationQueue()
    assert q.request(ledger, "a", "a", 60)  # room: reserved at once
    assert not q.request(ledger, "b", "b", 60)  # no room: waits
    assert not q.request(ledger, "c", "c", 20)  # would fit, but b is ahead
    assert len(q) == 2 and q.waited == 2 and "c" not in ledger
    assert q.grant(ledger) == []  # nothing released: still no room for the head
    ledger.release("a")
    assert q.grant(ledger) == ["b", "c"]  # the head, then the next while it fits
    assert len(q) == 0 and ledger.held("b") == 6 and ledger.held("c") == 2  # (blocks of 10 tokens)


def test_the_head_is_granted_first_and_ended_ones_are_passed_over() -> None:
    ledger = KVLedger(capacity=10, block_size=10)
    q: ReservationQueue[str] = ReservationQueue()
    assert q.request(ledger, "a", "a", 90)
    for key, tokens in (("big", 80), ("small", 10), ("gone", 10)):
        assert not q.request(ledger, key, key, tokens)
    assert q.grant(ledger) == []  # 10 tokens free: "small" fits but waits behind "big"
    ledger.release("a")
    assert q.grant(ledger, gone=lambda key: key == "big") == ["small", "gone"]  # big ended: dropped unreserved
    assert "big" not in ledger


def test_dropped_and_cleared_reservations_are_never_granted() -> None:
    ledger = KVLedger(capacity=1, block_size=10)
    q: ReservationQueue[int] = ReservationQueue()
    assert q.request(ledger, 1, "s1", 10)
    assert not q.request(ledger, 2, "s2", 10) and not q.request(ledger, 3, "s3", 10)
    assert q.drop(2) and not q.drop(2)
    assert q.clear() == [3] and len(q) == 0
    ledger.release("s1")
    assert q.grant(ledger) == [] and ledger.free == 1
