"""Layer-wise KV streaming inside one step (Splitwise §IV-C): each group of layers leaves once the step has run it.

A hop that hands KV to the next phase builds one `LayerStream` per step, before the step, from the parts the
transfer policy (`hetnode.policy.KVTransferPolicy`) streams: a session's positions of the step, the layers one
target of the next phase holds, and the group size. The engine calls it after each layer (it is the step's
`layer_done` hook), in the step's thread. When a group's last layer is done, it exports that group's keys and
values, packs them with the target link's codec and gives the bytes to `send`, which posts them to the KV
outbox from the event loop. The link therefore carries layer 0 while layer 1 computes, and when the step ends
only the last group is left to go.

A part stops at its first failure (an export or a pack that raises, a `send` that says no): its later groups
are not sent from here, so what did go is always a prefix of its layers, and the hop sends the rest with the
step's whole hand-off afterwards. The receiver takes a token range's KV in any number of layer groups, each
checked on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hetnode.errors import HetnodeError
from hetnode.ids import SessionId
from hetnode.kv.codecs import CODECS

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StreamPart:
    """Positions [start, end) of a session's layers [first_layer, last_layer), to `target` in `codec`, in groups
    of `group` layers (the last group may be shorter)."""

    session: SessionId
    target: str
    codec: str
    start: int
    end: int
    first_layer: int
    last_layer: int
    group: int

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end and 0 <= self.first_layer < self.last_layer and self.group >= 1):
            raise ValueError(f"an empty or malformed stream part: {self}")
        if self.codec not in CODECS:
            raise ValueError(f"unknown KV codec {self.codec!r}")

    def groups(self) -> list[tuple[int, int]]:
        """The layer ranges [a, b) sent one message each, in order."""
        return [(a, min(a + self.group, self.last_layer))
                for a in range(self.first_layer, self.last_layer, self.group)]


# (session, start, end, (first layer, end layer)) -> keys, values [layers, tokens, KV heads, head dim]
Export = Callable[[SessionId, int, int, tuple[int, int]], tuple[torch.Tensor, torch.Tensor]]
# (part, first layer, end layer, packed bytes) -> False when the part must stop (its session is gone)
Send = Callable[[StreamPart, int, int, memoryview], bool]


class LayerStream:
    """The `layer_done` hook of one step: sends every part's groups as their layers complete."""

    def __init__(self, parts: Sequence[StreamPart], export: Export, send: Send) -> None:
        self.parts = list(parts)
        self._export = export
        self._send = send
        # A group's last layer -> the groups that end there: (part index, first layer, end layer).
        self._due: dict[int, list[tuple[int, int, int]]] = {}
        for i, part in enumerate(self.parts):
            for a, b in part.groups():
                self._due.setdefault(b - 1, []).append((i, a, b))
        self._next = [part.first_layer for part in self.parts]  # the first layer of each part not sent yet
        self._stopped: set[int] = set()

    def sent(self, i: int) -> int:
        """Part i's layers [first_layer, sent) have gone out."""
        return self._next[i]

    def __call__(self, layer: int) -> None:
        for i, a, b in self._due.get(layer, ()):
            if i in self._stopped:
                continue
            part = self.parts[i]
            try:
                keys, values = self._export(part.session, part.start, part.end, (a, b))
                data = CODECS[part.codec].pack(keys, values)
            except (HetnodeError, ValueError) as exc:
                log.warning("streaming layers [%d, %d) of session %s failed (sent after the step instead): %s",
                            a, b, part.session, exc)
                self._stopped.add(i)
                continue
            if self._send(part, a, b, data):
                self._next[i] = b
            else:
                self._stopped.add(i)
