"""When a step's KV goes to the next phase: whole after the step, or layer by layer while it runs (Splitwise §IV-C).

A prefill hop that hands off sends the KV each step computes to the hops of the next phase. Sent whole, the
transfer starts when the step ends and the decode phase waits all of it out. Streamed layer-wise, each group
of layers leaves as soon as the step has run it, while the forward goes on with the next layers, so when the
step ends only the last group, and whatever the link has not caught up with, is still on its way.

Streaming costs something inside the step: each group is exported and packed between two layers in the step's
thread and is a message of its own to frame, queue and import, and the network work runs beside the forward
rather than after it, so the first token comes a little later. For a transfer that takes little time whole,
that cost outweighs what streaming hides. Splitwise therefore sends small prompts serialized and large ones
layer-wise, and so does this policy, by the time the transfer would take whole on its link: its wire bytes
(tokens x layers x bytes per token-layer of the link's codec) over the link's measured bandwidth, or over
`default_mbps` when the caller does not know it.

Groups: one message per layer hides the most, but every message has a fixed cost (an int codec's pack call
alone is ~0.7 ms here) and the KV outbox holds a bounded number of messages. A group is therefore at least
`min_group_bytes`, and a step sends at most `max_groups` groups per target.

The decision is per link (each target of the next phase has its own codec, layers and bandwidth), pure and
cheap, so the node's hop server and the simulator can ask the same object.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Mode = Literal["whole", "layerwise"]

# Measured with `scripts/bench_kv.py --section threshold [--mbps 1000]` (SmolLM2-135M, float32 CPU engine, fp16
# codec, one torch thread, a prefill and a decode hop server in one process over the link shaper, 2-core machine
# at load average ~1): layer-wise is worth it where the decode side becomes ready sooner by more than the first
# token loses to it. At 1 Gbit/s that held from 2.9 MB (24 ms whole on the wire) and failed at 1.5 MB (12 ms);
# at 100 Mbit/s it held from the smallest transfer that streams at all (92 KB, 7 ms). 20 ms is right at 1 Gbit/s
# and gives up a few ms at 100 Mbit/s below 250 KB. Under a load of ~3 the crossover moved up several times
# (streaming takes CPU from the step as it runs). Rows in docs/performance.md ("Layer-wise KV transfer").
MIN_LAYERWISE_S = 0.020
DEFAULT_MBPS = 100.0  # the link assumed when its bandwidth is not known (not yet measured)
MIN_GROUP_BYTES = 64 << 10  # one chunk of the link shaper, about what one TCP window moves
MAX_GROUPS = 16


TRANSFER_CHOICES = ("policy", "layerwise", "whole")  # a node's `--kv-transfer`


def transfer_policy(choice: str) -> KVTransferPolicy:
    """The policy a node's `--kv-transfer` names: this module's choice by size ("policy"), every transfer that
    splits into groups streamed ("layerwise"), or every one sent after the step ("whole"); the last two exist to
    measure one against the other on the same cluster."""
    if choice == "policy":
        return KVTransferPolicy()
    if choice == "layerwise":
        return KVTransferPolicy(min_layerwise_s=0.0)
    if choice == "whole":
        return KVTransferPolicy(min_layerwise_s=math.inf)
    raise ValueError(f"kv transfer must be one of {', '.join(TRANSFER_CHOICES)}, not {choice!r}")


@dataclass(frozen=True, slots=True)
class KVTransferChoice:
    mode: Mode
    group_layers: int  # layers per message: every layer of the transfer when whole
    groups: int  # messages per step for this target
    wire_bytes: int  # the whole transfer's bytes on the wire
    serial_s: float  # how long they take on the link, sent whole


@dataclass(frozen=True, slots=True)
class KVTransferPolicy:
    min_layerwise_s: float = MIN_LAYERWISE_S  # transfers shorter than this on their link go whole (>= 0)
    min_group_bytes: int = MIN_GROUP_BYTES  # smallest message a layer-wise transfer sends (>= 0)
    max_groups: int = MAX_GROUPS  # most messages a layer-wise transfer sends per step and target (>= 2)
    default_mbps: float = DEFAULT_MBPS  # the link's bandwidth when the caller does not know it (> 0)

    def __post_init__(self) -> None:
        if not self.min_layerwise_s >= 0:  # also refuses NaN
            raise ValueError(f"min_layerwise_s must be >= 0, not {self.min_layerwise_s}")
        if self.min_group_bytes < 0:
            raise ValueError(f"min_group_bytes must be >= 0, not {self.min_group_bytes}")
        if self.max_groups < 2:
            raise ValueError(f"max_groups must be >= 2 (one group is a whole transfer), not {self.max_groups}")
        if not (0 < self.default_mbps < math.inf):
            raise ValueError(f"default_mbps must be positive and finite, not {self.default_mbps}")

    def choose(self, tokens: int, layers: int, bytes_per_token_layer: float,
               link_mbps: float | None = None) -> KVTransferChoice:
        """How to send `tokens` tokens of `layers` layers' KV, at `bytes_per_token_layer` on the wire (the link's
        codec, scales included), over a link of `link_mbps` megabits per second (None: not known)."""
        if tokens < 1 or layers < 1:
            raise ValueError(f"a transfer has tokens >= 1 and layers >= 1, not {tokens} and {layers}")
        if not (0 < bytes_per_token_layer < math.inf):
            raise ValueError(f"bytes_per_token_layer must be positive and finite, not {bytes_per_token_layer}")
        if link_mbps is not None and not (0 < link_mbps <= math.inf):
            raise ValueError(f"link_mbps must be positive, not {link_mbps}")
        layer_bytes = tokens * bytes_per_token_layer
        wire = math.ceil(layer_bytes * layers)
        serial = wire * 8 / ((link_mbps or self.default_mbps) * 1e6)
        group = max(math.ceil(layers / self.max_groups), math.ceil(self.min_group_bytes / layer_bytes), 1)
        if serial < self.min_layerwise_s or group >= layers:
            return KVTransferChoice("whole", layers, 1, wire, serial)
        return KVTransferChoice("layerwise", group, math.ceil(layers / group), wire, serial)
