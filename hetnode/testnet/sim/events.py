"""The discrete-event core: a heap of (time, seq, kind, a, b) tuples, in simulated seconds only.

`seq` is a counter taken when an event is pushed, so events at the same time run in the order they were
scheduled: a run depends on nothing but its inputs and seed (no dict or set order, no wall clock). Tuples
compare on (time, seq) alone because seq is unique, so the payloads `a` and `b` never need to be comparable.

The simulator's main loop pops `queue.heap` with `heapq.heappop` itself (one attribute lookup less per event
than a method call); everything else goes through the methods.
"""

from __future__ import annotations

import heapq
import math
from itertools import count
from typing import Any

# Event kinds, in no particular order; the runner dispatches on them.
NODE_MESSAGE = 0  # a link message reached a compute node: a = node index, b = list of items
STEP_DONE = 1  # a node finished its step: a = node index, b = its duration
COORD_MESSAGE = 2  # a link message reached the coordinator: b = list of items
ARRIVAL = 3  # a request arrives at the coordinator: a = workload index
RELEASE = 4  # a session's Release reached a node: a = node index, b = the session
# handoff.py registers the KV hand-off's own kinds (Install, Ready, Failed "full", KV in, KV unpacked, packing
# done) with `Simulation.register`.

Event = tuple[float, int, int, Any, Any]


def grouped(keys: list[int], items: list[Any]) -> dict[int, list[Any]]:
    """items by key (a destination), each group in the items' order, groups in order of first appearance:
    one message per destination, in a deterministic order."""
    groups: dict[int, list[Any]] = {}
    for k, item in zip(keys, items, strict=True):
        g = groups.get(k)
        if g is None:
            groups[k] = [item]
        else:
            g.append(item)
    return groups


class EventQueue:
    __slots__ = ("heap", "now", "seq")

    def __init__(self) -> None:
        self.heap: list[Event] = []
        self.seq = count()  # the runner's hot loop takes next(seq) itself
        self.now = 0.0

    def push(self, time: float, kind: int, a: Any = None, b: Any = None) -> None:
        if not time >= self.now:  # also refuses NaN
            raise ValueError(f"event at {time} is in the past (now {self.now})")
        heapq.heappush(self.heap, (time, next(self.seq), kind, a, b))

    def pop(self) -> Event:
        event = heapq.heappop(self.heap)
        self.now = event[0]
        return event

    def peek_time(self) -> float:
        return self.heap[0][0] if self.heap else math.inf

    def __len__(self) -> int:
        return len(self.heap)
