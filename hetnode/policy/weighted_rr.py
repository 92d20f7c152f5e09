"""Data parallelism's dispatcher in Cronus §5.1: weighted round-robin over instances with bounded waiting queues.

The paper's DP baseline gives the A100 a weight of 3 and the A10 or A30 a weight of 1, and lets at most 3 and 1
requests wait at them (waiting: sent but not yet scheduled by the instance's engine). A request for which every
instance's queue is full stays at the frontend, in arrival order, until one has room. The order is smooth
weighted round-robin (nginx's: each pick adds every weight to its instance's credit and takes the largest, then
charges it the total), so a 3:1 pair goes A, A, B, A rather than A, A, A, B; an instance whose queue is full is
passed over for that pick, which keeps the dispatcher work-conserving.

Pure: the caller passes each instance's waiting count in.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping


class WeightedRoundRobin:
    def __init__(self, weights: Mapping[str, int], queue_limits: Mapping[str, int]) -> None:
        if not weights or set(weights) != set(queue_limits):
            raise ValueError("weights and queue_limits must name the same, non-empty set of instances")
        if any(w < 1 for w in weights.values()) or any(q < 1 for q in queue_limits.values()):
            raise ValueError(f"weights ({dict(weights)}) and queue limits ({dict(queue_limits)}) must be >= 1")
        self.weights = dict(weights)
        self.limits = dict(queue_limits)
        self.total = sum(self.weights.values())
        self.credit = dict.fromkeys(self.weights, 0)
        self.held: deque[str] = deque()  # requests at the frontend, arrival order
        self.decisions = 0

    def submit(self, request_id: str, waiting: Mapping[str, int]) -> list[tuple[str, str]]:
        """A request arrived; returns (request, instance) for each request sent now, in order."""
        self.held.append(request_id)
        return self.dispatch(waiting)

    def dispatch(self, waiting: Mapping[str, int]) -> list[tuple[str, str]]:
        """Send held requests while some instance has room (call when an instance schedules a waiting request)."""
        counts = {name: waiting.get(name, 0) for name in self.weights}
        out = []
        while self.held:
            room = [name for name in self.weights if counts[name] < self.limits[name]]
            if not room:
                break
            for name in room:
                self.credit[name] += self.weights[name]
            pick = max(room, key=lambda name: self.credit[name])  # ties: the first named
            self.credit[pick] -= sum(self.weights[name] for name in room)
            counts[pick] += 1
            self.decisions += 1
            out.append((self.held.popleft(), pick))
        return out
