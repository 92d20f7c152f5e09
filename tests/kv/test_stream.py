"""The per-step layer hook that streams KV: each group leaves when its last layer is done, packed with its codec; a
part stops at its first failure, so what went is always a prefix of its layers."""

from __future__ import annotations

import pytest
import torch

from hetnode.errors import HetnodeError
from hetnode.ids import SessionId
from hetnode.kv.codecs import CODECS
from hetnode.kv.stream import LayerStream, StreamPart

S, T = SessionId("s"), SessionId("t")
KVH, D = 3, 12
KEYS = torch.randn(10, 8, KVH, D)  # layers 0..9 of positions 0..7
VALUES = torch.randn(10, 8, KVH, D)


def export(session: SessionId, start: int, end: int, layers: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    a, b = layers
    return KEYS[a:b, start:end], VALUES[a:b, start:end]


def test_each_group_leaves_when_its_last_layer_is_done_in_order() -> None:
    sent: list[tuple[str, str, int, int, bytes]] = []
    parts = [StreamPart(S, "d0", "fp16", 0, 8, 2, 7, 2), StreamPart(T, "d1", "int8", 4, 8, 5, 10, 3)]
    assert parts[0].groups() == [(2, 4), (4, 6), (6, 7)] and parts[1].groups() == [(5, 8), (8, 10)]

    def send(part: StreamPart, a: int, b: int, data: memoryview) -> bool:
        sent.append((part.session, part.target, a, b, bytes(data)))
        return True

    stream = LayerStream(parts, export, send)
    done: list[list[tuple[int, int]]] = []
    for layer in range(2, 10):  # a shard of layers [2, 10)
        stream(layer)
        done.append([(a, b) for _, _, a, b, _ in sent])
    assert done[1] == [(2, 4)] and done[3] == [(2, 4), (4, 6)]  # after layers 3 and 5
    assert [(s, t, a, b) for s, t, a, b, _ in sent] == [
        ("s", "d0", 2, 4), ("s", "d0", 4, 6), ("s", "d0", 6, 7), ("t", "d1", 5, 8), ("t", "d1", 8, 10)]
    assert [stream.sent(i) for i in range(2)] == [7, 10]
    # Each frame is the codec's packing of exactly those layers and positions.
    _, _, _, _, data = sent[3]
    keys, _ = CODECS["int8"].unpack(data, 3, 4, KVH, D, torch.float32)
    assert torch.allclose(keys, KEYS[5:8, 4:8], atol=0.05)
    assert data == bytes(CODECS["int8"].pack(KEYS[5:8, 4:8], VALUES[5:8, 4:8]))


@pytest.mark.parametrize("failure", ["export", "pack", "send"])
def test_a_part_stops_at_its_first_failure_and_the_others_go_on(failure: str) -> None:
    sent: list[tuple[SessionId, int, int]] = []

    def flaky_export(session: SessionId, start: int, end: int, layers: tuple[int, int]) -> tuple[torch.Tensor, ...]:
        if failure == "export" and session == S and layers == (2, 4):
            raise HetnodeError("session s holds no KV here")
        keys, values = export(session, start, end, layers)
        if failure == "pack" and session == S and layers == (2, 4):
            keys = keys.clone()
            keys[0, 0, 0, 0] = float("nan")  # an int codec refuses NaN
        return keys, values

    def send(part: StreamPart, a: int, b: int, data: memoryview) -> bool:
        if failure == "send" and part.session == S and (a, b) == (2, 4):
            return False  # the session is gone
        sent.append((part.session, a, b))
        return True

    parts = [StreamPart(S, "d", "int8", 0, 8, 0, 6, 2), StreamPart(T, "d", "int8", 0, 8, 0, 6, 2)]
    stream = LayerStream(parts, flaky_export, send)  # type: ignore[arg-type]
    for layer in range(6):
        stream(layer)
    assert [(a, b) for s, a, b in sent if s == S] == [(0, 2)]  # nothing after the failed group
    assert [(a, b) for s, a, b in sent if s == T] == [(0, 2), (2, 4), (4, 6)]
    assert (stream.sent(0), stream.sent(1)) == (2, 6)


def test_a_malformed_part_is_refused() -> None:
    for bad in [(4, 4, 0, 2, 1, "fp16"), (0, 8, 3, 3, 1, "fp16"), (0, 8, 0, 2, 0, "fp16"), (0, 8, 0, 2, 1, "zip")]:
        start, end, first, last, group, codec = bad
        with pytest.raises(ValueError):
            StreamPart(S, "d", codec, start, end, first, last, group)
