"""What we need from a GGUF file: its metadata as a `ModelConfig`, and single tensors under Hugging Face names.

The header is read and the file memory-mapped by `gguf_header.py`, so reading one tensor touches only that
tensor's pages; `gguf.quants` dequantizes it. Two things
differ from a Hugging Face checkpoint and are undone here exactly as transformers' GGUF loader does:
tensor names (`blk.3.attn_q.weight` is `model.layers.3.self_attn.q_proj.weight`), and llama.cpp's
permutation of the Q and K rows of `llama`-architecture files (it converts HF's rotate-half RoPE layout to
its interleaved one; Qwen2 files keep the HF layout).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from hetnode.errors import ConfigError
from hetnode.models.config import ModelConfig, RopeConfig
from hetnode.models.gguf_header import GGUFHeader, GGUFTensorInfo

if TYPE_CHECKING:
    import torch

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


@functools.lru_cache(maxsize=4)
def _open(path: str, mtime_ns: int) -> GGUFHeader:
    return GGUFHeader(path)


def open_gguf(path: Path) -> GGUFHeader:
    """The file's header, shared between its config and its weights."""
    try:
        return _open(str(path), path.stat().st_mtime_ns)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read GGUF file: {exc}", file=str(path)) from exc


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name for a Hugging Face parameter name of a Llama-family model."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_RE.fullmatch(hf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise KeyError(f"no GGUF name for {hf_name!r}")
    return f"blk.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.{match.group(3)}"


def _field(reader: GGUFHeader, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


def config_from_gguf(reader: GGUFHeader) -> ModelConfig:
    arch = str(_field(reader, "general.architecture", ""))
    name = str(_field(reader, "general.name", "")).lower()
    if arch not in ("llama", "qwen2"):
        raise ConfigError(f"GGUF architecture {arch!r} is not one we run (llama, qwen2)")
    tensor_names = {t.name for t in reader.tensors}

    def key(suffix: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{suffix}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    scaling = str(key("rope.scaling.type", "none"))
    rope_kwargs: dict[str, Any] = {"theta": float(key("rope.freq_base", 10000.0))}
    if scaling in ("linear", "yarn"):
        rope_kwargs.update(rope_type=scaling, factor=float(key("rope.scaling.factor", 1.0)))
        if key("rope.scaling.original_context_length") is not None:
            rope_kwargs["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
    elif scaling != "none":
        raise ConfigError(f"GGUF RoPE scaling {scaling!r} is not supported")
    eos = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens) if tokens is not None else 0)
    return ModelConfig(
        # llama.cpp files Mistral under "llama"; transformers tells them apart by the model name, as we do.
        arch="mistral" if arch == "llama" and "mistral" in name else arch,
        num_layers=int(key("block_count")),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(key("attention.key_length") or key("rope.dimension_count") or hidden // heads),
        intermediate_size=int(key("feed_forward_length")),
        vocab_size=int(vocab),
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        rope=RopeConfig(**rope_kwargs),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        bos_token_id=int(_field(reader, "tokenizer.ggml.bos_token_id", -1)),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        checkpoint_dtype="float32",  # we dequantize to float32 on load
    )


class GGUFTensors:
    """Tensors of one GGUF file under Hugging Face names, dequantized to float32 on demand."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._reader = open_gguf(path)
        self.config = config_from_gguf(self._reader)
        self._arch = str(_field(self._reader, "general.architecture", ""))
        self._tensors: dict[str, GGUFTensorInfo] = {t.name: t for t in self._reader.tensors}

    def has(self, hf_name: str) -> bool:
        try:
            return gguf_name(hf_name) in self._tensors
        except KeyError:
            return False

    def get(self, hf_name: str) -> torch.Tensor:
        import torch  # here, not at the top: the coordinator reads GGUF configs and must not load torch

        tensor = self._tensors[gguf_name(hf_name)]
        weights = dequantize(tensor.data, tensor.tensor_type)
        if self._arch == "llama" and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = self.config.num_heads if ".attn_q." in tensor.name else self.config.num_kv_heads
            weights = unpermute_qk(weights, heads)
        # dequantize returns a fresh array for quantized types but a view of the memory map for F32 ones;
        # copy so that the tensor owns writable memory and the file can be closed.
        return torch.from_numpy(np.array(weights, copy=True))


# Rows dequantized per call: gguf.quants.dequantize takes 16 rows at a time, so a shard's thousands of small
# numpy calls cost more than their arithmetic (2-3 s of a SmolLM2 node's start); a few million elements at a time
# do the same arithmetic (its own dequantize_rows, so the values are identical) with the temporaries bounded.
_CHUNK_ELEMENTS = 1 << 21


def dequantize(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """A GGUF tensor's values as float32, the same values as `gguf.quants.dequantize`."""
    codec = getattr(quants, qtype.name, None)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or codec is None or data.ndim == 0:
        return np.asarray(quants.dequantize(data, qtype), dtype=np.float32)
    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = data.reshape(-1, data.shape[-1])
    width = rows.shape[1] // type_size * block  # values per row
    out = np.empty((rows.shape[0], width), dtype=np.float32)
    step = max(1, _CHUNK_ELEMENTS // max(1, width))
    for start in range(0, rows.shape[0], step):
        out[start:start + step] = codec.dequantize_rows(rows[start:start + step])
    return out.reshape(*data.shape[:-1], width)


def unpermute_qk(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: within each head, rows (2i, 2i+1) go back to (i, i + D/2)."""
    # weights: [heads * D, H] (or [heads * D] for a bias)
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
