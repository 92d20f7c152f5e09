"""Rotary position embeddings: the inverse frequencies of each RoPE variant, and cos/sin per token.

The formulas follow transformers' `modeling_rope_utils` operation for operation (same dtypes, same order),
so that our cos/sin tables equal the reference bit for bit and greedy decoding can match token for token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from hetnode.models.config import ModelConfig, RopeConfig


def _base_inv_freq(theta: float | torch.Tensor, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3(rope: RopeConfig, dim: int, max_positions: int) -> torch.Tensor:
    inv_freq = _base_inv_freq(rope.theta, dim)
    old_context = rope.original_max_position_embeddings or max_positions
    low_wavelen = old_context / rope.low_freq_factor
    high_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by `factor`, short ones kept, the band between interpolated smoothly.
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    factor, base = rope.factor, rope.theta
    original = rope.original_max_position_embeddings or max_positions

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.attention_factor:
        attention = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention = float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
    else:
        attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp below would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation_weight = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, attention


def inv_frequencies(
    rope: RopeConfig, head_dim: int, max_positions: int, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [D/2] float32, cos/sin scale). `seq_len` only matters for dynamic NTK."""
    dim = head_dim
    if rope.rope_type == "default":
        return 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope.rope_type == "linear":
        return _base_inv_freq(rope.theta, dim) / rope.factor, 1.0
    if rope.rope_type == "dynamic":
        if seq_len is None or seq_len <= max_positions:
            return _base_inv_freq(rope.theta, dim), 1.0
        # Past the trained context the base grows with the length. transformers computes this from a tensor
        # length in float32, so do we: float64 here would move the frequencies by an ulp or two.
        length = torch.tensor(seq_len, dtype=torch.int64)
        base = rope.theta * ((rope.factor * length / max_positions) - (rope.factor - 1)) ** (dim / (dim - 2))
        return _base_inv_freq(base, dim), 1.0
    if rope.rope_type == "llama3":
        return _llama3(rope, dim, max_positions), 1.0
    return _yarn(rope, dim, max_positions)


class Rotary:
    """cos/sin for the positions of a step, from a table that grows on demand (dynamic NTK: per item)."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self._rope = config.rope
        self._head_dim = config.head_dim
        self._max_positions = config.max_position_embeddings
        self._device = device
        self._inv_freq, self._scale = inv_frequencies(config.rope, config.head_dim, self._max_positions)
        self._cos = self._sin = torch.empty(0, config.head_dim, device=device)
        self._grow(min(self._max_positions, 4096))

    def _table(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [P]; result: 2 x [P, D] float32, scaled
        freqs = positions.to(torch.float)[:, None] * inv_freq.to(device=positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self._scale, emb.sin() * self._scale

    def _grow(self, size: int) -> None:
        self._cos, self._sin = self._table(torch.arange(size, device=self._device), self._inv_freq)

    def cos_sin(
        self, positions: torch.Tensor, segments: Sequence[tuple[int, int]], dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, D] in `dtype` for `positions` ([T], on the device).

        `segments` lists (tokens, sequence length after the step) per item in order; only dynamic NTK reads
        it, because its frequencies depend on the length of the sequence being processed.
        """
        if self._rope.rope_type == "dynamic":
            cos_parts, sin_parts, row = [], [], 0
            for count, length in segments:
                inv_freq, _ = inv_frequencies(self._rope, self._head_dim, self._max_positions, length)
                cos, sin = self._table(positions[row : row + count], inv_freq)
                cos_parts.append(cos)
                sin_parts.append(sin)
                row += count
            return torch.cat(cos_parts).to(dtype), torch.cat(sin_parts).to(dtype)
        needed = max(length for _, length in segments)
        if needed > self._cos.shape[0]:
            self._grow(max(needed, 2 * self._cos.shape[0]))
        return self._cos[positions].to(dtype), self._sin[positions].to(dtype)
