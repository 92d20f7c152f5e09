"""Tiny random-weight Llama, Mistral and Qwen2 models in the Hugging Face format, written on the fly for tests.

Sizes are deliberately odd (hidden 72, 6 heads of 12, 3 KV heads, MLP 200, 5 layers) so that a transposed
weight or a head_dim mix-up fails loudly instead of broadcasting. Weights are seeded, so a test sees the same
model every run, and are scaled so that logits are well separated: greedy decoding then does not hinge on
round-off, and token-for-token comparisons with transformers are meaningful.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.",
    "A peer-to-peer network serves language models on heterogeneous GPUs spread over many regions.",
    "Each node runs a contiguous range of layers and streams hidden states to the next node.",
    "Tokens are a few bytes; activations are hidden size times the bytes of one number per token.",
    "What is the capital of Spain? Madrid. What is two plus two? Four. Hello, world!",
    "the quick brown fox jumps over the lazy dog 0123456789 ,.;:!?()[]{}<>'\"-+*/=_",
]


def build_tiny_tokenizer(vocab_size: int = 300) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained in milliseconds on a fixed corpus (no download), ChatML template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def tiny_config(
    arch: str = "llama",
    *,
    vocab_size: int,
    num_layers: int = 5,
    hidden_size: int = 72,
    num_heads: int = 6,
    num_kv_heads: int = 3,
    intermediate_size: int = 200,
    max_position_embeddings: int = 256,
    rope_theta: float = 10000.0,
    rope_scaling: dict[str, Any] | None = None,
    tie_word_embeddings: bool | None = None,
    attention_bias: bool = False,
    sliding_window: int | None = None,
    max_window_layers: int = 0,
) -> dict[str, Any]:
    """A config.json dict in the classic on-hub format (`rope_theta` + `rope_scaling`)."""
    classes = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    cfg: dict[str, Any] = {
        "architectures": [classes[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        # Qwen2 ties its embeddings at small sizes; our tiny Llama unties them so both code paths run.
        "tie_word_embeddings": arch == "qwen2" if tie_word_embeddings is None else tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "llama":
        cfg.update(attention_bias=attention_bias, mlp_bias=False)
    elif arch == "mistral":
        cfg["sliding_window"] = sliding_window
    else:
        cfg.update(
            use_sliding_window=sliding_window is not None,
            sliding_window=sliding_window or 4096,
            max_window_layers=max_window_layers,
        )
    return cfg


def random_weights(cfg: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    """Seeded weights under Hugging Face parameter names."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    head_dim = cfg["head_dim"]
    q_size, kv_size = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    qkv_bias = cfg["model_type"] == "qwen2" or cfg.get("attention_bias", False)
    o_bias = cfg["model_type"] == "llama" and cfg.get("attention_bias", False)

    def linear(out: int, inp: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out, inp, generator=gen) * (gain / math.sqrt(inp))

    def norm(size: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(size, generator=gen)

    def bias(size: int) -> torch.Tensor:
        return 0.2 * torch.randn(size, generator=gen)

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": 0.3 * torch.randn(vocab, hidden, generator=gen)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(hidden)
        w[p + "self_attn.q_proj.weight"] = linear(q_size, hidden, 2.0)
        w[p + "self_attn.k_proj.weight"] = linear(kv_size, hidden, 2.0)
        w[p + "self_attn.v_proj.weight"] = linear(kv_size, hidden)
        w[p + "self_attn.o_proj.weight"] = linear(hidden, q_size, 1.5)
        if qkv_bias:
            w[p + "self_attn.q_proj.bias"] = bias(q_size)
            w[p + "self_attn.k_proj.bias"] = bias(kv_size)
            w[p + "self_attn.v_proj.bias"] = bias(kv_size)
        if o_bias:
            w[p + "self_attn.o_proj.bias"] = bias(hidden)
        w[p + "post_attention_layernorm.weight"] = norm(hidden)
        w[p + "mlp.gate_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.up_proj.weight"] = linear(inter, hidden)
        w[p + "mlp.down_proj.weight"] = linear(hidden, inter, 1.5)
    w["model.norm.weight"] = norm(hidden)
    if not cfg["tie_word_embeddings"]:
        w["lm_head.weight"] = linear(vocab, hidden, 3.0)
    return w


def write_tiny_model(dest: Path, arch: str = "llama", *, seed: int = 0, shards: int = 1, **overrides: Any) -> Path:
    """Write config.json, safetensors weights (split over `shards` files) and a tokenizer into `dest`.

    `overrides` go to `tiny_config` (num_layers, rope_scaling, sliding_window, ...). Returns `dest`.
    """
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    tokenizer.save_pretrained(str(dest))
    cfg = tiny_config(arch, vocab_size=len(tokenizer), **overrides)
    (dest / "config.json").write_text(json.dumps(cfg, indent=2))
    weights = random_weights(cfg, seed)
    names = list(weights)
    if shards == 1:
        save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
        return dest
    weight_map: dict[str, str] = {}
    per_shard = math.ceil(len(names) / shards)
    for s in range(shards):
        filename = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: weights[n] for n in names[s * per_shard : (s + 1) * per_shard]}
        save_file(part, str(dest / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, filename))
    index = {"metadata": {"total_size": sum(t.nbytes for t in weights.values())}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return dest
