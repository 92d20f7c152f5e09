"""KV codecs: every codec keeps the error bound its docstring promises, sizes are exact, bad payloads are refused."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hetnode.errors import ProtocolError
from hetnode.kv.codecs import CODECS, DEFAULT_GROUP, CastCodec, GroupQuantCodec

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def kv_pair(
    shape: tuple[int, int, int, int], seed: int, magnitude: float, dtype: torch.dtype, outliers: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V; `outliers` huge values planted in one key channel and one value token (KIVI's picture)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(shape, generator=gen) * magnitude
    v = torch.randn(shape, generator=gen) * magnitude + magnitude  # not centred on 0: zero points matter
    if outliers:
        _, tokens, _, dim = shape
        channel = int(torch.randint(dim, (1,), generator=gen))
        rows = torch.randint(tokens, (outliers,), generator=gen)
        k[:, rows, :, channel] *= 100.0  # within fp16's range even at magnitude 50
        v[:, int(rows[0])] *= 100.0
    return k.to(dtype), v.to(dtype)


def stats_of(codec: GroupQuantCodec, data: memoryview, shape: tuple[int, int, int, int]) -> list[torch.Tensor]:
    """Per-element scale of K and of V, read from the payload by the wire layout the module documents."""
    layers, tokens, heads, dim = shape
    g = codec.group_size
    n = math.prod(shape)
    code_bytes = -(-n * codec.bits // 8)
    raw = bytes(data)
    out, pos = [], 0
    for stat_shape, axis in (((layers, -(-tokens // g), heads, dim), 1), ((layers, tokens, heads, -(-dim // g)), 3)):
        pos += code_bytes
        count = math.prod(stat_shape)
        scale = torch.frombuffer(bytearray(raw[pos : pos + 2 * count]), dtype=torch.float16).view(stat_shape)
        pos += 4 * count
        out.append(scale.float().repeat_interleave(g, dim=axis).narrow(axis, 0, shape[axis]))
    assert pos == len(raw)
    return out


shapes = st.tuples(
    st.integers(1, 3), st.integers(1, 90), st.integers(1, 3), st.integers(1, 24)
)  # layers, tokens (odd ones too), KV heads, head dim


@settings(max_examples=150, deadline=None)
@given(
    shape=shapes,
    bits=st.sampled_from([2, 4, 8]),
    group=st.sampled_from([1, 2, 3, 7, 16, 32, 64, 128]),
    seed=st.integers(0, 2**31 - 1),
    magnitude=st.sampled_from([1e-3, 1.0, 50.0]),
    dtype=st.sampled_from(DTYPES),
    outliers=st.integers(0, 3),
)
def test_quantized_round_trip_stays_within_half_a_scale(
    shape: tuple[int, int, int, int],
    bits: int,
    group: int,
    seed: int,
    magnitude: float,
    dtype: torch.dtype,
    outliers: int,
) -> None:
    codec = GroupQuantCodec(bits, group)
    k, v = kv_pair(shape, seed, magnitude, dtype, outliers)
    data = codec.pack(k, v)
    assert data.nbytes == codec.packed_size(*shape)
    k2, v2 = codec.unpack(data, *shape, dtype=torch.float32)
    assert k2.shape == v2.shape == shape and k2.dtype == torch.float32
    for x, x2, scale, axis in zip((k, v), (k2, v2), stats_of(codec, data, shape), (1, 3), strict=True):
        x = x.float()
        err = (x - x2).abs()
        assert (err <= scale / 2 * (1 + 1e-5) + 1e-6 * x.abs()).all(), float((err - scale / 2).max())
        # The stored scale is the group's range over 2^bits - 1, rounded outward to fp16, and no larger.
        g = min(group, shape[axis])
        pad = -shape[axis] % g
        padded = torch.cat([x, x.narrow(axis, shape[axis] - 1, 1).expand_as(x.narrow(axis, 0, pad))], dim=axis)
        split = [*padded.shape[:axis], -1, g, *padded.shape[axis + 1 :]]
        lo = padded.view(split).amin(axis + 1).repeat_interleave(g, dim=axis).narrow(axis, 0, shape[axis])
        hi = padded.view(split).amax(axis + 1).repeat_interleave(g, dim=axis).narrow(axis, 0, shape[axis])
        widest = (hi - lo + lo.abs() * 2**-10 + 2**-24) / (2**bits - 1) * (1 + 2**-9) + 2**-23
        assert (scale <= widest).all()


def test_keys_are_quantized_per_channel_so_an_outlier_channel_spares_the_others() -> None:
    # KIVI's reason for per-channel keys: one channel 1000x larger must not coarsen the other channels.
    shape = (1, 64, 1, 8)
    k, v = kv_pair(shape, seed=1, magnitude=1.0, dtype=torch.float32)
    k[..., 3] *= 1000.0
    k2, _ = CODECS["int4"].unpack(CODECS["int4"].pack(k, v), *shape, dtype=torch.float32)
    others = [c for c in range(8) if c != 3]
    spread = (k[..., others].amax(1) - k[..., others].amin(1)).max()
    assert (k2[..., others] - k[..., others]).abs().max() <= spread / 15 / 2 * 1.01
    assert (k2[..., 3] - k[..., 3]).abs().max() > spread  # the outlier channel pays for its own range


@settings(max_examples=60, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_fp16_round_trip_of_fp16_input_is_exact(shape: tuple[int, int, int, int], seed: int) -> None:
    k, v = kv_pair(shape, seed, 10.0, torch.float16, outliers=1)
    for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        k, v = k.to(dtype), v.to(dtype)
        data = CODECS[name].pack(k, v)
        assert data.nbytes == CODECS[name].packed_size(*shape) == 4 * math.prod(shape)
        k2, v2 = CODECS[name].unpack(bytes(data), *shape, dtype=dtype)
        assert torch.equal(k2, k) and torch.equal(v2, v)


@settings(max_examples=40, deadline=None)
@given(shape=shapes, seed=st.integers(0, 2**31 - 1))
def test_fp32_round_trip_of_fp32_input_is_exact(shape: tuple[int, int, int, int], seed: int) -> None:
    k, v = kv_pair(shape, seed, 10.0, torch.float32, outliers=1)
    data = CODECS["fp32"].pack(k, v)
    assert data.nbytes == CODECS["fp32"].packed_size(*shape) == 8 * math.prod(shape)
    k2, v2 = CODECS["fp32"].unpack(bytes(data), *shape, dtype=torch.float32)
    assert torch.equal(k2, k) and torch.equal(v2, v)


def test_cast_codecs_round_float32_by_half_an_ulp() -> None:
    shape = (2, 33, 2, 16)
    k, v = kv_pair(shape, seed=3, magnitude=5.0, dtype=torch.float32)
    for name, rel in (("fp16", 2**-11), ("bf16", 2**-8)):
        k2, v2 = CODECS[name].unpack(CODECS[name].pack(k, v), *shape, dtype=torch.float32)
        assert ((k2 - k).abs() <= k.abs() * rel + 2**-24).all()
        assert ((v2 - v).abs() <= v.abs() * rel + 2**-24).all()


def test_int4_is_over_3_5x_smaller_than_fp16_with_its_scales_at_the_default_group() -> None:
    assert DEFAULT_GROUP == 64
    for shape in ((30, 512, 3, 64), (1, 2048, 8, 128)):  # SmolLM2-135M, one LLaMA-2 70B layer
        fp16 = CODECS["fp16"].packed_size(*shape)
        assert fp16 / CODECS["int4"].packed_size(*shape) == pytest.approx(128 / 36)
        assert fp16 / CODECS["int8"].packed_size(*shape) == pytest.approx(128 / 68)
        assert fp16 / CODECS["int2"].packed_size(*shape) == pytest.approx(128 / 20)


def test_packed_size_counts_short_groups_and_partial_bytes() -> None:
    codec = GroupQuantCodec(2, group_size=4)
    # 1*5*1*3 = 15 codes -> 4 bytes each for K and V; K stats: ceil(5/4)=2 x 3 channels; V: 5 tokens x 1 group.
    assert codec.packed_size(1, 5, 1, 3) == 2 * 4 + 4 * (2 * 3) + 4 * (5 * 1)
    k, v = kv_pair((1, 5, 1, 3), seed=0, magnitude=1.0, dtype=torch.float32)
    assert codec.pack(k, v).nbytes == codec.packed_size(1, 5, 1, 3)


def test_a_constant_group_round_trips_exactly() -> None:
    k = torch.full((2, 10, 1, 4), 0.3)  # 0.3 is not an fp16 number: the zero point rounds down, scale covers it
    v = torch.full((2, 10, 1, 4), -7.0)
    for name in ("int8", "int4", "int2"):
        k2, v2 = CODECS[name].unpack(CODECS[name].pack(k, v), 2, 10, 1, 4, dtype=torch.float32)
        assert torch.equal(v2, v)
        assert (k2 - k).abs().max() <= 1e-4


@pytest.mark.parametrize("name", sorted(CODECS))
def test_unpack_into_the_cache_dtype(name: str) -> None:
    shape = (2, 17, 2, 8)
    k, v = kv_pair(shape, seed=5, magnitude=1.0, dtype=torch.float32)
    for dtype in DTYPES:
        k2, v2 = CODECS[name].unpack(CODECS[name].pack(k, v), *shape, dtype=dtype)
        assert k2.dtype == v2.dtype == dtype and k2.shape == v2.shape == shape
        assert k2.is_contiguous() and v2.is_contiguous()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_payload_of_the_wrong_size_is_a_protocol_error(name: str) -> None:
    codec = CODECS[name]
    shape = (2, 9, 2, 8)
    data = bytes(codec.pack(*kv_pair(shape, seed=2, magnitude=1.0, dtype=torch.float32)))
    for bad in (data[:-1], data + b"\0", b""):
        with pytest.raises(ProtocolError, match=rf"{name} KV payload of {len(bad)} bytes, expected {len(data)}"):
            codec.unpack(bad, *shape, dtype=torch.float32)
    with pytest.raises(ProtocolError, match="expected"):
        codec.unpack(data, 2, 10, 2, 8, dtype=torch.float32)  # the header claims one token more
    with pytest.raises(ProtocolError, match="empty dimension"):
        codec.unpack(data, 2, 0, 2, 8, dtype=torch.float32)


def test_a_non_finite_scale_in_a_payload_is_a_protocol_error() -> None:
    codec = CODECS["int4"]
    shape = (1, 4, 1, 4)
    data = bytearray(codec.pack(*kv_pair(shape, seed=2, magnitude=1.0, dtype=torch.float32)))
    code_bytes = math.prod(shape) // 2
    data[code_bytes : code_bytes + 2] = (
        torch.tensor([math.inf], dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    )
    with pytest.raises(ProtocolError, match="non-finite"):
        codec.unpack(data, *shape, dtype=torch.float32)


def test_pack_refuses_what_fp16_stats_cannot_describe() -> None:
    k, v = kv_pair((1, 8, 1, 4), seed=0, magnitude=1.0, dtype=torch.float32)
    for bad in (math.nan, math.inf, -1e6):
        k_bad = k.clone()
        k_bad[0, 3, 0, 1] = bad
        with pytest.raises(ValueError, match="overflows fp16"):
            CODECS["int8"].pack(k_bad, v)
    with pytest.raises(ValueError, match=r"\[L, T, KVH, D\]"):
        CODECS["int4"].pack(k, v[:, :4])
    with pytest.raises(ValueError, match="floating point"):
        CODECS["fp16"].pack(k.to(torch.int32), v.to(torch.int32))


def test_unpacked_tensors_do_not_alias_the_receive_buffer() -> None:
    shape = (1, 3, 1, 4)
    k, v = kv_pair(shape, seed=0, magnitude=1.0, dtype=torch.float16)
    buffer = bytearray(CODECS["fp16"].pack(k, v))
    k2, _ = CODECS["fp16"].unpack(buffer, *shape, dtype=torch.float16)
    buffer[:] = bytes(len(buffer))
    assert torch.equal(k2, k)


def test_codec_registry_and_arguments() -> None:
    assert set(CODECS) == {"fp16", "bf16", "fp32", "int8", "int4", "int2"}
    assert all(codec.name == name for name, codec in CODECS.items())
    assert isinstance(CODECS["bf16"], CastCodec)
    with pytest.raises(ValueError, match="bits"):
        GroupQuantCodec(3)
    with pytest.raises(ValueError, match="group_size"):
        GroupQuantCodec(4, group_size=0)
