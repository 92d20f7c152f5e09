"""The size of a KV frame's payload for each codec, without torch: what a receiver checks a frame against and
what the coordinator prices a hand-off with. `hetnode.kv.codecs` packs exactly these sizes (its module docstring
gives the layout)."""

from __future__ import annotations

KV_GROUP = 64  # tokens (keys) or channels (values) per quantization group; `hetnode.kv.codecs` says why 64
_BITS = {"int8": 8, "int4": 4, "int2": 2}
_CASTS = {"fp16": 2, "bf16": 2, "fp32": 4}  # bytes per element


def packed_size(codec: str, layers: int, tokens: int, kv_heads: int, head_dim: int, group: int = KV_GROUP) -> int:
    """Bytes of keys and values of this shape in `codec`, scales and zero points included."""
    n = layers * tokens * kv_heads * head_dim
    if codec in _CASTS:
        return 2 * _CASTS[codec] * n
    bits = _BITS.get(codec)
    if bits is None:
        raise ValueError(f"unknown KV codec {codec!r}")
    per_byte = 8 // bits
    # One fp16 scale and one fp16 zero per group: keys grouped along tokens, values along channels.
    stats = layers * -(-tokens // group) * kv_heads * head_dim + layers * tokens * kv_heads * -(-head_dim // group)
    return 2 * -(-n // per_byte) + 2 * 2 * stats
