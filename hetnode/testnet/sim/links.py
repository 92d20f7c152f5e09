"""Directed links under the alpha-beta model, each with a FIFO queue.

A message of n bytes sent at time t on a link of bandwidth B (bytes/s) and one-way latency a starts to
transmit when the link has finished every earlier message (the FIFO queue), occupies the link for n / B, and
arrives a after its last byte left:

    start = max(t, free);  free = start + n / B;  arrival = free + a

So queueing delay (start - t) emerges wherever the offered load nears the bandwidth, the way Helix §6.7 sees
prompt activations wait for seconds on slow inter-region links. Each direction of a pair is its own link
(full duplex), as the cluster file's symmetric `LinkSpec` applies to both. Latency is a pure delay: messages
pipeline over it, only serialization is exclusive. An unlimited link (bandwidth inf) transmits in zero time.

The model leaves out loss and TCP's slow start; it keeps per-link statistics for the utilization and
queueing-delay figures: busy time, bytes, messages, and the queueing delay per message and per item (with
prompt items counted apart, since they are the big ones).
"""

from __future__ import annotations

import math


class SimLink:
    __slots__ = (
        "busy_s",
        "bytes",
        "bytes_per_s",
        "free",
        "items",
        "latency_s",
        "messages",
        "name",
        "pf_items",
        "pf_queue_s",
        "queue_item_s",
        "queue_max_s",
        "queue_s",
        "queued_messages",
        "s_per_token",
        "token_bytes",
        "window_busy_s",
    )

    def __init__(self, name: str, bytes_per_s: float, latency_s: float, token_bytes: float) -> None:
        if not bytes_per_s > 0 or not latency_s >= 0 or not token_bytes >= 0:
            raise ValueError(f"link {name}: bad bandwidth {bytes_per_s}, latency {latency_s} or token size "
                             f"{token_bytes}")
        self.name = name
        self.bytes_per_s = bytes_per_s
        self.latency_s = latency_s
        self.token_bytes = token_bytes  # what one token of an item takes on this link
        self.s_per_token = 0.0 if math.isinf(bytes_per_s) else token_bytes / bytes_per_s
        self.free = 0.0  # when the link has sent everything queued so far
        self.messages = 0
        self.items = 0
        self.bytes = 0.0
        self.busy_s = 0.0
        self.window_busy_s = 0.0  # busy time inside the measured window
        self.queue_s = 0.0  # sum over messages of their queueing delay
        self.queue_max_s = 0.0
        self.queued_messages = 0  # messages that found the link busy
        self.queue_item_s = 0.0  # sum over items of their queueing delay
        self.pf_items = 0  # prompt (prefill) items carried
        self.pf_queue_s = 0.0  # sum over prompt items of their queueing delay

    def send(self, now: float, tokens: int, items: int, prompt_items: int, window: tuple[float, float],
             token_bytes: float | None = None) -> float:
        """Queue a message of `tokens` tokens in `items` items (each token `token_bytes` on the wire, by default
        what this link usually carries); returns its arrival time at the far end."""
        free = self.free
        start = free if free > now else now
        if token_bytes is None:
            tx = tokens * self.s_per_token
            self.bytes += tokens * self.token_bytes
        else:
            tx = 0.0 if math.isinf(self.bytes_per_s) else tokens * token_bytes / self.bytes_per_s
            self.bytes += tokens * token_bytes
        end = start + tx
        self.free = end
        self.messages += 1
        self.items += items
        self.busy_s += tx
        lo, hi = window
        if end > lo and start < hi:
            self.window_busy_s += (end if end < hi else hi) - (start if start > lo else lo)
        self.pf_items += prompt_items
        if start > now:
            wait = start - now
            self.queued_messages += 1
            self.queue_s += wait
            self.queue_item_s += wait * items
            self.pf_queue_s += wait * prompt_items
            if wait > self.queue_max_s:
                self.queue_max_s = wait
        return end + self.latency_s
