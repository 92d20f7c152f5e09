"""A GGUF file's metadata and tensor index, read in milliseconds.

The `gguf` package's reader builds a numpy view per metadata item: a Llama-family file carries its whole
vocabulary and merge list (about 100k strings for SmolLM2) as metadata, so opening one took 6 s here, and every
testnet process (each node, the coordinator) paid it before serving. This reads the same header with `struct`
over a memory map (the format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md, version 2 and 3,
little-endian) and gives each tensor the same numpy view of its bytes that `gguf.GGUFReader` gives, so
`gguf.quants.dequantize` takes it unchanged and reading one tensor touches only that tensor's pages.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types: struct formats of the scalar ones; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGML's order: the fastest-varying dimension first
    data: np.ndarray  # the raw bytes (or values), shaped as gguf.GGUFReader shapes them


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands (say which byte and why)."""


class GGUFHeader:
    """The metadata (`fields`: key -> Python value; arrays of strings as lists of str, numeric arrays as numpy
    arrays) and tensors (`tensors`: in file order) of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._take(4) != _MAGIC:
            raise GGUFFormatError("not a GGUF file (no GGUF magic at byte 0)")
        version = self._scalar("I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_fields = self._scalar("Q"), self._scalar("Q")
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(self._scalar("I"))
        infos = [self._tensor_info() for _ in range(n_tensors)]
        alignment = int(self.fields.get("general.alignment", _DEFAULT_ALIGNMENT))
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"general.alignment {alignment} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        # A plain array over the map, not np.memmap: dequantizing slices it thousands of times, and each
        # np.memmap slice runs Python-level bookkeeping (a third of the load time of a shard).
        memory = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors: list[GGUFTensorInfo] = []
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise GGUFFormatError(f"tensor {name!r} appears twice")
            seen.add(name)
            try:
                qtype = GGMLQuantizationType(raw_type)
            except ValueError:
                raise GGUFFormatError(f"tensor {name!r} has unknown type {raw_type}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
            n_bytes = elements * type_size // block
            begin = start + offset
            if begin + n_bytes > len(memory):
                raise GGUFFormatError(f"tensor {name!r} runs past the end of the file")
            np_dims = tuple(reversed(dims))
            raw = memory[begin:begin + n_bytes]
            dtype = _NUMPY.get(qtype)
            data = (raw.view(dtype).reshape(np_dims) if dtype is not None
                    else raw.reshape(quant_shape_to_byte_shape(np_dims, qtype)))
            self.tensors.append(GGUFTensorInfo(name, qtype, dims, data))

    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._map):
            raise GGUFFormatError(f"the header ends early (at byte {self._pos}, {n} more wanted)")
        out = self._map[self._pos:end]
        self._pos = end
        return out

    def _scalar(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack("<" + fmt, self._take(size))[0]

    def _string(self) -> str:
        return self._take(self._scalar("Q")).decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._scalar("I"), self._scalar("Q")
            if item == _STRING:
                return self._strings(count)
            if item in _SCALARS:
                fmt = "<" + _SCALARS[item]
                raw = self._take(count * struct.calcsize(fmt))
                return np.frombuffer(raw, dtype=np.dtype(fmt.replace("?", "b1")))
            return [self._value(item) for _ in range(count)]
        raise GGUFFormatError(f"unknown GGUF value type {kind} at byte {self._pos - 4}")

    def _strings(self, count: int) -> list[str]:
        # The hot loop (the vocabulary): offsets into the map, one slice per string.
        buf, pos, out = self._map, self._pos, []
        unpack = struct.Struct("<Q").unpack_from
        end = len(buf)
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFFormatError(f"a string array ends early (at byte {pos})")
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > end:
                raise GGUFFormatError(f"a string array ends early (at byte {pos})")
            out.append(buf[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        self._pos = pos
        return out

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar("I")
        if n_dims > 8:
            raise GGUFFormatError(f"tensor {name!r} has {n_dims} dimensions")
        dims = tuple(int(self._scalar("Q")) for _ in range(n_dims))
        return name, dims, int(self._scalar("I")), int(self._scalar("Q"))
