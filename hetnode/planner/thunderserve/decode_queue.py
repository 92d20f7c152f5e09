"""A decode replica's KV as requests of varying length queue for it: when each sampled request gets room, and the
rate the replica sustains when it never runs dry (`first_token` is the prefill side; both stand in for DistServe's
simulator, which ThunderServe's D comes from, §3.3).

A request holds tokens of KV from the moment it gets room until its last token: its prompt and, on average over
that time, half its output (`need`), for as long as its decode takes, and its hand-off where the KV is booked
before it (`hold`). Room is given first come first served and a request that does not fit waits, with everyone
behind it (as the simulator's and the runtime's KV queues do, Appendix E): so a long prompt that waits for room
idles the room that shorter ones could use. An estimate at the mean context sees neither that nor the wait near
capacity. Measured (issue 14): on one coding plan the simulator's hand-offs waited 4.7 s (median) for decode
replicas the mean-context estimate gave room to spare, the KV held through hand-offs queued on 5 Gb/s links; the
packing itself costs little on a 4x3090 Ti replica (8.7 requests/s sustained for the coding trace's lengths
against 8.8 at the mean).

The replica batches at most `slots` requests at once (ThunderServeOptions.max_batch, vLLM's max_num_seqs).
Event by event over the sample, a few milliseconds; the planner remembers each layout's results.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from hetnode.planner.thunderserve.first_token import Array


def room_at(arrivals: Array, need: Array, hold: Array, kv_tokens: float, slots: int) -> Array:
    """When each request (in arrival order) gets room: first come first served, at most `slots` at once and
    `kv_tokens` in all; inf for one that could never fit (more than the whole KV), which waits for nothing."""
    start: list[float] = []
    free = kv_tokens
    running: list[tuple[float, float]] = []  # (end, tokens), the earliest end first
    last = 0.0  # no one starts before the one ahead of it
    pop, push = heapq.heappop, heapq.heappush
    for came, tokens, held in zip(arrivals.tolist(), need.tolist(), hold.tolist(), strict=True):
        if tokens > kv_tokens:
            start.append(math.inf)
            continue
        t = came if came > last else last
        while running and (running[0][0] <= t or free < tokens or len(running) >= slots):
            end, freed = pop(running)
            if end > t:
                t = end
            free += freed
        free -= tokens
        push(running, (t + held, tokens))
        start.append(t)
        last = t
    return np.array(start)


def sustained(need: Array, hold: Array, kv_tokens: float, slots: int) -> float:
    """Requests per second the replica serves with a queue that never empties (every request there at once): the
    rate its starts keep between the tenth and the ninetieth request, past the start-up and before the drain."""
    start = room_at(np.zeros(len(need)), need, hold, kv_tokens, slots)
    fits = np.sort(start[np.isfinite(start)])
    if len(fits) < 10:
        return 0.0
    a, b = len(fits) // 10, len(fits) * 9 // 10
    span = float(fits[b] - fits[a])
    return (b - a) / span if span > 0 else math.inf
