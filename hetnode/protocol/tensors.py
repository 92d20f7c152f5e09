"""Tensors to and from the raw frames that follow their TensorMeta: no pickling, no copy into msgpack."""

from __future__ import annotations

import torch

from hetnode.errors import ProtocolError
from hetnode.protocol.messages import TensorMeta

_TORCH = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
    "int32": torch.int32, "int8": torch.int8, "uint8": torch.uint8,
}
_NAMES = {v: k for k, v in _TORCH.items()}


def to_wire(t: torch.Tensor) -> tuple[TensorMeta, memoryview]:
    t = t.detach().to("cpu").contiguous()
    name = _NAMES.get(t.dtype)
    if name is None:
        raise ValueError(f"no wire form for {t.dtype}")
    # bf16 has no buffer-protocol format; its bytes travel as int16 of the same width.
    raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
    return TensorMeta(dtype=name, shape=list(t.shape)), memoryview(raw.numpy()).cast("B")  # type: ignore[arg-type]


def from_wire(meta: TensorMeta, payload: bytes) -> torch.Tensor:
    if len(payload) != meta.nbytes():
        raise ProtocolError(f"tensor payload of {len(payload)} bytes for {meta.dtype}{meta.shape}")
    dtype = _TORCH[meta.dtype]
    if not payload:
        return torch.empty(meta.shape, dtype=dtype)
    return torch.frombuffer(bytearray(payload), dtype=dtype).reshape(meta.shape)


def token_tensor(ids: list[int]) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)
