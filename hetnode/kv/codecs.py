"""KV codecs for moving a session's keys and values between nodes: fp16/bf16 casts and KIVI-style int8/int4/int2.

A codec exists for the wire only (ThunderServe §4): the sender packs, the receiver unpacks into its own cache
dtype, and attention always runs on the dequantized values. Both sides see K and V as [L, T, KVH, D] (layers,
tokens, KV heads, head dim), keys after RoPE, as the paged cache stores them.

The integer codecs use KIVI's layout (Liu et al., 2024): keys are quantized per channel, each (layer, head,
channel) cut into groups of `group_size` tokens, because key outliers sit in a few fixed channels and a
per-channel group keeps one channel's outlier out of every other channel's scale; values are quantized per
token, each (layer, token, head) cut into groups of `group_size` channels, because value outliers follow
tokens. Every group stores a scale and a zero point (its rounded-down minimum), both fp16, asymmetric:
x' = q * scale + zero with q in [0, 2^bits - 1].

Wire layout of one payload (all little-endian, nothing between the parts):

    key codes     ceil(L*T*KVH*D * bits / 8) bytes   q of [L, T, KVH, D] in C order, packed low bits first
    key stats     2 * L * ceil(T/G) * KVH * D fp16  scales, then zeros, each [L, ceil(T/G), KVH, D]
    value codes   ceil(L*T*KVH*D * bits / 8) bytes
    value stats   2 * L * T * KVH * ceil(D/G) fp16  scales, then zeros, each [L, T, KVH, ceil(D/G)]

A last group shorter than G (T or D not a multiple of G) is quantized over its real elements only; its
stats cost as much as a full group's, which `packed_size` counts.
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod
from typing import Any

import numpy as np
import torch

from hetnode.errors import ProtocolError
from hetnode.protocol.kv_wire import KV_GROUP, packed_size

# The wire is little-endian; the fp16 stats and casts are written in the host's order, and the code packing
# reads words in the host's order after numpy arithmetic. Every platform torch supports here is little-endian.
if sys.byteorder != "little":
    raise ImportError("hetnode.kv.codecs writes the wire in host byte order and needs a little-endian host")

# 64, not KIVI's 32 or 128: it is the smallest group for which int4 stays 3.5x smaller than fp16 with its
# fp16 scale and zero counted (4 stats bytes per 32 code bytes: 128/36 = 3.56x; at 32 it would be 3.2x), and
# it equals the head dim of the small models we serve, so a value group is one head of one token.
DEFAULT_GROUP = KV_GROUP

# float32 elements one pass works on (4 MiB): a reused buffer of this size spares the page faults of a
# full-size float32 copy, and is large enough that the ~30 small torch calls per chunk cost little (measured
# on this 2-core EPYC with 1 thread: 2^18 gave 0.85 GB/s int4 pack, 2^20 1.2 GB/s, 2^21 no better).
_CHUNK = 1 << 20


class KVCodec(ABC):
    """Packs the keys and values of `layers` layers and `tokens` tokens into bytes, and back."""

    name: str

    @abstractmethod
    def packed_size(self, layers: int, tokens: int, kv_heads: int, head_dim: int) -> int:
        """Exact length of `pack`'s output for K and V of this shape, stats included."""

    @abstractmethod
    def pack(self, k: torch.Tensor, v: torch.Tensor) -> memoryview:
        """k, v: [L, T, KVH, D], any float dtype, on any device (the work runs on the CPU, copied over chunk by
        chunk). Returns the payload: a view of a fresh CPU buffer, which nothing else holds."""

    @abstractmethod
    def unpack(
        self,
        data: bytes | bytearray | memoryview,
        layers: int,
        tokens: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V, each [L, T, KVH, D] of `dtype` on the CPU. Raises ProtocolError when `data` is not exactly
        `packed_size` bytes for this shape (the shape and the bytes come from the network)."""

    def _check(self, data: bytes | bytearray | memoryview, shape: tuple[int, int, int, int]) -> torch.Tensor:
        if any(n < 1 for n in shape):
            raise ProtocolError(f"{self.name} KV payload: shape {shape} has an empty dimension")
        expected = self.packed_size(*shape)
        view = memoryview(data).cast("B")
        if view.nbytes != expected:
            raise ProtocolError(
                f"{self.name} KV payload of {view.nbytes} bytes, expected {expected} for [L, T, KVH, D] = {shape}"
            )
        # torch warns on a read-only buffer (it cannot promise not to write): give it a writable copy then.
        return torch.frombuffer(bytearray(view) if view.readonly else view, dtype=torch.uint8)


def _check_pair(k: torch.Tensor, v: torch.Tensor) -> tuple[int, int, int, int]:
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"keys and values must both be [L, T, KVH, D], got {tuple(k.shape)} and {tuple(v.shape)}")
    if not (k.is_floating_point() and v.is_floating_point()):
        raise ValueError(f"keys and values must be floating point, got {k.dtype} and {v.dtype}")
    if k.numel() == 0:
        raise ValueError(f"empty KV of shape {tuple(k.shape)}")
    layers, tokens, kv_heads, head_dim = k.shape
    return layers, tokens, kv_heads, head_dim


class CastCodec(KVCodec):
    """K and V cast to a float type, one after the other in C order.

    Error: exact for input already of `wire_dtype`; otherwise the cast's rounding, at most half a unit in the
    last place of `wire_dtype` (relative 2^-11 for fp16, 2^-8 for bf16). fp16 turns |x| > 65504 into inf: a
    cache whose values can exceed that should travel as bf16. fp32 is "as is" for nodes that compute in fp32
    (CPU nodes): twice fp16's bytes, and exact there.
    """

    def __init__(self, name: str, wire_dtype: torch.dtype) -> None:
        self.name = name
        self.wire_dtype = wire_dtype

    def packed_size(self, layers: int, tokens: int, kv_heads: int, head_dim: int) -> int:
        return packed_size(self.name, layers, tokens, kv_heads, head_dim)

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> memoryview:
        shape = _check_pair(k, v)
        n = math.prod(shape)
        out = torch.empty(2 * n, dtype=self.wire_dtype)
        out[:n].view(shape).copy_(k)  # one pass: the copy casts
        out[n:].view(shape).copy_(v)
        return out.view(torch.uint8).numpy().data

    def unpack(
        self,
        data: bytes | bytearray | memoryview,
        layers: int,
        tokens: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (layers, tokens, kv_heads, head_dim)
        raw = self._check(data, shape).view(self.wire_dtype)
        n = math.prod(shape)
        # Copies even when dtype is the wire's: the result must not alias the caller's receive buffer.
        return raw[:n].view(shape).to(dtype, copy=True), raw[n:].view(shape).to(dtype, copy=True)


class GroupQuantCodec(KVCodec):
    """Asymmetric `bits`-bit quantization in KIVI's layout (see the module docstring), `8 // bits` codes a byte.

    Error bound, per element: |x - x'| <= scale / 2 of the element's group, computed in float32 (so up to
    float32 rounding, relative ~1e-7 of |x|), plus the rounding of the output dtype when that is narrower.
    scale is about (max - min) / (2^bits - 1) of the group: the stats are rounded to fp16 outward (the zero
    down, the scale up) so that the codes always cover the whole [min, max] and no element is clipped.
    `pack` raises ValueError when a stat does not fit fp16: NaN or inf in the input, a group minimum below
    -65504, or a group range above 65504 * (2^bits - 1).
    """

    def __init__(self, bits: int, group_size: int = DEFAULT_GROUP) -> None:
        if bits not in (2, 4, 8):
            raise ValueError(f"bits must be 2, 4 or 8, not {bits}")
        if group_size < 1:
            raise ValueError(f"group_size must be positive, not {group_size}")
        self.bits = bits
        self.group_size = group_size
        self.name = f"int{bits}"
        self._per_byte = 8 // bits
        self._qmax = (1 << bits) - 1

    def packed_size(self, layers: int, tokens: int, kv_heads: int, head_dim: int) -> int:
        return packed_size(self.name, layers, tokens, kv_heads, head_dim, self.group_size)

    def _stat_shapes(self, shape: tuple[int, int, int, int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        layers, tokens, kv_heads, head_dim = shape
        g = self.group_size
        return (layers, -(-tokens // g), kv_heads, head_dim), (layers, tokens, kv_heads, -(-head_dim // g))

    def _parts(self, x: torch.Tensor, axis: int) -> list[torch.Tensor]:
        """x [L, T, KVH, D] (or a tensor of that shape's stats or codes) as views [A, B, g, C], one group per
        (a, b, c) along dim 2: the full groups, then the short last group if the axis has one."""
        layers, tokens, kv_heads, head_dim = x.shape
        n = x.shape[axis]
        full = n // self.group_size * self.group_size
        cuts = [(0, full, self.group_size)] if full else []
        if full < n:
            cuts.append((full, n, n - full))
        if axis == 1:  # keys: per channel, groups of tokens
            rows = x.reshape(layers, tokens, kv_heads * head_dim)
            return [rows[:, a:b].view(layers, (b - a) // g, g, -1) for a, b, g in cuts]
        rows = x.reshape(-1, head_dim)  # values: per token, groups of channels
        return [rows[:, a:b].view(rows.shape[0], (b - a) // g, g, 1) for a, b, g in cuts]

    # -- pack ---------------------------------------------------------------------------------------------

    def pack(self, k: torch.Tensor, v: torch.Tensor) -> memoryview:
        shape = _check_pair(k, v)
        n = math.prod(shape)
        out = torch.empty(self.packed_size(*shape), dtype=torch.uint8)
        code_bytes = -(-n // self._per_byte)
        codes = torch.empty(code_bytes * self._per_byte, dtype=torch.uint8)  # reused for K, then V
        codes[n:] = 0  # the last byte's unused codes
        scratch = _Scratch()
        pos = 0
        for x, axis, stat_shape in zip((k, v), (1, 3), self._stat_shapes(shape), strict=True):
            stats = torch.empty(2, *stat_shape, dtype=torch.float16)
            x_parts = self._parts(x.detach(), axis)
            code_parts = self._parts(codes[:n].view(shape), axis)
            stat_parts = _stat_views(stats, axis, [p.shape[1] for p in x_parts])
            for src, dst, st in zip(x_parts, code_parts, stat_parts, strict=True):
                for idx in _chunks(src):
                    self._quantize(src[idx], dst[idx], st[(slice(None), *idx)], scratch)
            if not torch.isfinite(stats).all():
                raise ValueError(
                    f"{self.name}: KV holds NaN or inf, or values whose scale or zero overflows fp16 (+-65504)"
                )
            out_np = out.numpy()
            out_np[pos : pos + code_bytes] = _pack_codes(codes.numpy(), self.bits)
            pos += code_bytes
            stat_bytes = stats.view(-1).view(torch.uint8)
            out[pos : pos + stat_bytes.numel()] = stat_bytes
            pos += stat_bytes.numel()
        assert pos == out.numel()
        return out.numpy().data

    def _quantize(self, src: torch.Tensor, dst: torch.Tensor, stats: torch.Tensor, scratch: _Scratch) -> None:
        """src [a, b, g, C] any float dtype -> dst codes (uint8, same shape), stats [2, a, b, 1, C] fp16."""
        # Work in float32 in a small reused buffer: CPU arithmetic on fp16/bf16 is emulated and slow, and a
        # fresh full-size float32 copy costs more in page faults than the arithmetic itself.
        buf = scratch.get(src.shape)
        buf.copy_(src)
        lo = buf.amin(2, keepdim=True)
        hi = buf.amax(2, keepdim=True)
        zero = _round_fp16(lo, down=True)
        zf = zero.float()
        scale = _round_fp16((hi - zf) / self._qmax, down=False)
        stats[0].copy_(scale)
        stats[1].copy_(zero)
        s = scale.float()
        inv = torch.where(s > 0, 1.0 / s, 0.0)  # a constant group: every code 0, and x' = zero = x
        # q = round((x - zero) / scale), in [0, qmax] without a clamp: the outward-rounded stats cover the
        # group. Subtract before scaling: x * inv - zero * inv would lose the codes' low bits to cancellation
        # when |zero| is large against the group's range. (NaN input gives junk codes, and stats that
        # `pack` refuses.)
        buf.sub_(zf).mul_(inv).round_()
        # numpy's float32 -> uint8 cast is several times faster than torch's on CPU.
        with np.errstate(invalid="ignore"):
            np.copyto(dst.numpy(), buf.numpy(), casting="unsafe")

    # -- unpack -------------------------------------------------------------------------------------------

    def unpack(
        self,
        data: bytes | bytearray | memoryview,
        layers: int,
        tokens: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (layers, tokens, kv_heads, head_dim)
        raw = self._check(data, shape)
        n = math.prod(shape)
        code_bytes = -(-n // self._per_byte)
        scratch = _Scratch()
        pos = 0
        result = []
        for axis, stat_shape in zip((1, 3), self._stat_shapes(shape), strict=True):
            codes = torch.from_numpy(_unpack_codes(raw[pos : pos + code_bytes].numpy(), self.bits))
            pos += code_bytes
            count = 2 * math.prod(stat_shape)
            # Cloned: after codes of odd length the stats start at an odd offset, which a float16 view rejects.
            stats = raw[pos : pos + 2 * count].clone().view(torch.float16).view(2, *stat_shape).float()
            pos += 2 * count
            if not torch.isfinite(stats).all():
                raise ProtocolError(f"{self.name} KV payload has a non-finite scale or zero")
            out = torch.empty(shape, dtype=dtype)
            code_parts = self._parts(codes[:n].view(shape), axis)
            stat_parts = _stat_views(stats, axis, [p.shape[1] for p in code_parts])
            for src, dst, st in zip(code_parts, self._parts(out, axis), stat_parts, strict=True):
                for idx in _chunks(src):
                    buf = scratch.get(src[idx].shape)
                    np.copyto(buf.numpy(), src[idx].numpy(), casting="unsafe")
                    st_idx = st[(slice(None), *idx)]
                    buf.mul_(st_idx[0]).add_(st_idx[1])
                    dst[idx].copy_(buf)
            result.append(out)
        return result[0], result[1]


class _Scratch:
    """One float32 buffer reused by every chunk of a call, grown when a chunk needs more."""

    def __init__(self) -> None:
        self._buf = torch.empty(0, dtype=torch.float32)

    def get(self, shape: torch.Size) -> torch.Tensor:
        n = math.prod(shape)
        if self._buf.numel() < n:
            self._buf = torch.empty(max(n, _CHUNK), dtype=torch.float32)
        return self._buf[:n].view(shape)


def _chunks(part: torch.Tensor) -> list[tuple[slice, slice]]:
    """Index pairs over the [A, B] grid of part [A, B, g, C] that cut it into pieces of about _CHUNK elements:
    whole rows of A while a row fits, else pieces of one row. (A loop over chunks, not over tokens or groups.)"""
    rows, cols = part.shape[0], part.shape[1]
    unit = part.shape[2] * part.shape[3]
    per = max(1, _CHUNK // unit)
    if cols <= per:
        step = max(1, per // cols)
        return [(slice(a, min(a + step, rows)), slice(0, cols)) for a in range(0, rows, step)]
    return [(slice(a, a + 1), slice(b, min(b + per, cols))) for a in range(rows) for b in range(0, cols, per)]


def _stat_views(stats: torch.Tensor, axis: int, groups: list[int]) -> list[torch.Tensor]:
    """stats [2, *stat shape] as views [2, A, B, 1, C] beside `_parts`' [A, B, g, C], part by part."""
    if axis == 1:  # [2, L, nG, KVH, D] -> [2, L, nG, 1, KVH*D]
        flat = stats.reshape(2, stats.shape[1], stats.shape[2], 1, -1)
    else:  # [2, L, T, KVH, nG] -> [2, L*T*KVH, nG, 1, 1]
        flat = stats.reshape(2, -1, stats.shape[-1], 1, 1)
    views, start = [], 0
    for count in groups:
        views.append(flat.narrow(2, start, count))
        start += count
    return views


def _pack_codes(codes: np.ndarray[Any, Any], bits: int) -> np.ndarray[Any, Any]:
    """Codes (uint8, a multiple of per = 8 // bits of them) packed: byte j holds codes j*per .. j*per + per - 1,
    the first in its lowest bits."""
    if bits == 8:
        return codes
    # Read the codes of a byte as one little-endian word and fold its bytes onto the lowest; the cast to uint8
    # keeps the low byte. int4: c0 | c1 << 4. int2: c0 | c1 << 2 | c2 << 4 | c3 << 6.
    packed: np.ndarray[Any, Any]
    if bits == 4:
        w = codes.view("<u2")
        packed = (w | (w >> 4)).astype(np.uint8)
    else:
        w = codes.view("<u4")
        packed = (w | (w >> 6) | (w >> 12) | (w >> 18)).astype(np.uint8)
    return packed


def _unpack_codes(packed: np.ndarray[Any, Any], bits: int) -> np.ndarray[Any, Any]:
    """The inverse of `_pack_codes`: (8 // bits) uint8 codes per byte."""
    if bits == 8:
        return packed
    # Spread each byte over a little-endian word, one code in the low bits of each of its bytes.
    if bits == 4:
        w = packed.astype("<u2")
        w = (w | (w << 4)) & 0x0F0F
    else:
        w = packed.astype("<u4")
        w = (w | (w << 6) | (w << 12) | (w << 18)) & 0x03030303
    codes: np.ndarray[Any, Any] = w.view(np.uint8)
    return codes


def _round_fp16(x: torch.Tensor, *, down: bool) -> torch.Tensor:
    """x (float32) to fp16, rounded toward -inf (down) or +inf, so that it stays a bound of x."""
    h = x.to(torch.float16)
    off = h.float() > x if down else h.float() < x
    step = torch.nextafter(h, torch.tensor(-math.inf if down else math.inf, dtype=torch.float16))
    return torch.where(off, step, h)


CODECS: dict[str, KVCodec] = {
    codec.name: codec
    for codec in (
        CastCodec("fp16", torch.float16),
        CastCodec("fp32", torch.float32),
        CastCodec("bf16", torch.bfloat16),
        GroupQuantCodec(8),
        GroupQuantCodec(4),
        GroupQuantCodec(2),
    )
}
