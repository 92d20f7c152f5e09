"""RoPE: our inverse frequencies and cos/sin equal transformers' for every variant the configs use."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from hetnode.models.config import ModelConfig
from hetnode.node.engine.rope import Rotary, inv_frequencies

VARIANTS: list[dict[str, Any] | None] = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "beta_fast": 16.0,
     "mscale": 1.0, "mscale_all_dim": 0.5},
]


def _configs(scaling: dict[str, Any] | None) -> tuple[LlamaConfig, ModelConfig]:
    raw = {
        "model_type": "llama", "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 32, "max_position_embeddings": 256,
        "rope_theta": 50000.0, "rope_scaling": scaling,
    }
    return LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"}), ModelConfig.from_hf_dict(raw)


@pytest.mark.parametrize("scaling", VARIANTS, ids=lambda s: (s or {}).get("rope_type", "default"))
def test_inverse_frequencies_equal_transformers(scaling: dict[str, Any] | None) -> None:
    hf, ours = _configs(scaling)
    for seq_len in (None, 1000):  # only dynamic NTK depends on the length
        inv, scale = inv_frequencies(ours.rope, ours.head_dim, ours.max_position_embeddings, seq_len)
        if scaling is None:
            expected, expected_scale = LlamaRotaryEmbedding.compute_default_rope_parameters(hf)
        else:
            length = None if seq_len is None else torch.tensor(seq_len)
            expected, expected_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, None, seq_len=length)
        assert torch.equal(inv, expected)
        assert scale == pytest.approx(expected_scale)


@pytest.mark.parametrize("scaling", VARIANTS[:2] + VARIANTS[4:5], ids=["default", "linear", "yarn"])
def test_cos_sin_equal_transformers_bit_for_bit(scaling: dict[str, Any] | None) -> None:
    hf, ours = _configs(scaling)
    positions = torch.tensor([0, 1, 7, 63, 200, 255, 300])  # 300: past the first table, which then grows
    cos, sin = Rotary(ours, torch.device("cpu")).cos_sin(positions, [(len(positions), 301)], torch.float32)
    ref_cos, ref_sin = LlamaRotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), positions[None, :])
    assert torch.equal(cos, ref_cos[0]) and torch.equal(sin, ref_sin[0])
