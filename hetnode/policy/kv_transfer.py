"""When a step's KV goes to the next phase: whole after the step, or layer by layer while it runs (Splitwise §IV-C).

A prefill hop that hands off sends the KV each step computes to the hops of the next phase. Sent whole, the
transfer starts when the step ends and the decode phase waits all of it out. Streamed layer-wise, each group
of layers leaves as soon as the step has run it, while the forward goes on with the next layers, so when the
step ends only the last group, and whatever the link has not caught up with, is still on its way.

Streaming costs a little inside the step: each group is exported and packed between two layers in the step's
thread and is a message of its own to frame, queue and import, and the first token waits for that work. For a
small transfer, which takes little time whole, the cost outweighs what it hides. Splitwise therefore sends
small prompts serialized and large ones layer-wise, and so does this policy, by the bytes the transfer puts on
the wire (tokens x layers x bytes per token-layer of the link's codec).

Groups: one message per layer hides the most, but every message has a fixed cost (an int codec's pack call
alone is ~0.7 ms here) and the KV outbox holds a bounded number of messages. A group is therefore at least
`min_group_bytes`, and a step sends at most `max_groups` groups per target.

The decision is per link (each target of the next phase has its own codec and layers), pure and cheap, so the
node's hop server and the simulator can ask the same object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Mode = Literal["whole", "layerwise"]

# Measured with `scripts/bench_kv.py --section threshold` (SmolLM2-135M, float32 CPU engine, fp16 codec, one
# torch thread, two in-process hop servers over the link shaper at 100 Mbit/s and 1 ms): the wire bytes from
# which streaming a step's KV layer-wise made the decode side ready sooner, counted from the step's start.
# See that section's docstring and docs/performance.md for the measured rows.
MIN_LAYERWISE_BYTES = 256 << 10
MIN_GROUP_BYTES = 64 << 10  # one chunk of the link shaper, about what one TCP window moves
MAX_GROUPS = 16


@dataclass(frozen=True, slots=True)
class KVTransferChoice:
    mode: Mode
    group_layers: int  # layers per message: every layer of the transfer when whole
    groups: int  # messages per step for this target
    wire_bytes: int  # the whole transfer's bytes on the wire


@dataclass(frozen=True, slots=True)
class KVTransferPolicy:
    min_layerwise_bytes: int = MIN_LAYERWISE_BYTES  # smaller transfers go whole, after the step
    min_group_bytes: int = MIN_GROUP_BYTES  # smallest message a layer-wise transfer sends (>= 0)
    max_groups: int = MAX_GROUPS  # most messages a layer-wise transfer sends per step and target (>= 2)

    def __post_init__(self) -> None:
        if self.min_layerwise_bytes < 0 or self.min_group_bytes < 0:
            raise ValueError(f"byte thresholds must be >= 0, not {self.min_layerwise_bytes}, {self.min_group_bytes}")
        if self.max_groups < 2:
            raise ValueError(f"max_groups must be >= 2 (one group is a whole transfer), not {self.max_groups}")

    def choose(self, tokens: int, layers: int, bytes_per_token_layer: float) -> KVTransferChoice:
        """How to send `tokens` tokens of `layers` layers' KV, at `bytes_per_token_layer` on the wire (the link's
        codec, scales included)."""
        if tokens < 1 or layers < 1:
            raise ValueError(f"a transfer has tokens >= 1 and layers >= 1, not {tokens} and {layers}")
        if not (0 < bytes_per_token_layer < math.inf):
            raise ValueError(f"bytes_per_token_layer must be positive and finite, not {bytes_per_token_layer}")
        layer_bytes = tokens * bytes_per_token_layer
        wire = math.ceil(layer_bytes * layers)
        group = max(math.ceil(layers / self.max_groups), math.ceil(self.min_group_bytes / layer_bytes), 1)
        if wire < self.min_layerwise_bytes or group >= layers:
            return KVTransferChoice("whole", layers, 1, wire)
        return KVTransferChoice("layerwise", group, math.ceil(layers / group), wire)
