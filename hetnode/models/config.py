"""The shape of a Llama-family decoder, read from a Hugging Face config.json (GGUF metadata: `gguf_file.py`).

Every field has a default, a bound and a one-line doc (`bounded`), and `__post_init__` checks the bounds, so a
config that made it into an object is one the engine can run.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetnode.errors import ConfigError

ARCHS = ("llama", "mistral", "qwen2")
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


def bounded(default: Any, doc: str, lo: float | None = None, hi: float | None = None) -> Any:
    """A dataclass field with its doc and inclusive numeric bounds, checked by `check_bounds`."""
    return field(default=default, metadata={"doc": doc, "lo": lo, "hi": hi})


def check_bounds(obj: Any) -> None:
    """Raise `ConfigError` naming the first field of a `bounded` dataclass that is out of its bounds."""
    for f in dataclasses.fields(obj):
        value, lo, hi = getattr(obj, f.name), f.metadata.get("lo"), f.metadata.get("hi")
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        # Written as "not inside" so that NaN, which compares false with everything, is out of bounds too.
        if (lo is not None and not value >= lo) or (hi is not None and not value <= hi):
            raise ConfigError(f"{value} is outside [{lo}, {hi}] ({f.metadata['doc']})", key=f.name)


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters, in transformers' `rope_parameters` vocabulary."""

    rope_type: str = bounded("default", "one of default, linear, dynamic, llama3, yarn")
    theta: float = bounded(10000.0, "base wavelength (rope_theta)", 1.0, 1e12)
    factor: float = bounded(1.0, "context extension factor (linear, dynamic, llama3, yarn)", 1e-3, 1e6)
    original_max_position_embeddings: int = bounded(
        0, "pre-training context length for llama3 and yarn; 0 means max_position_embeddings", 0, 1 << 24
    )
    low_freq_factor: float = bounded(1.0, "llama3: wavelengths above ctx/low_freq_factor are scaled", 1e-6, 1e6)
    high_freq_factor: float = bounded(4.0, "llama3: wavelengths below ctx/high_freq_factor are kept", 1e-6, 1e6)
    beta_fast: float = bounded(32.0, "yarn: rotations where extrapolation ends", 1e-6, 1e6)
    beta_slow: float = bounded(1.0, "yarn: rotations where interpolation begins", 1e-6, 1e6)
    attention_factor: float = bounded(0.0, "yarn: cos/sin scale; 0 derives it from factor and mscale", 0.0, 1e3)
    mscale: float = bounded(0.0, "yarn: numerator mscale when attention_factor is derived (0: unset)", 0.0, 1e3)
    mscale_all_dim: float = bounded(0.0, "yarn: denominator mscale (0: unset)", 0.0, 1e3)
    truncate: bool = bounded(True, "yarn: round the correction range to whole dimensions")

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"unsupported RoPE type {self.rope_type!r} (supported: {ROPE_TYPES})", key="rope")

    @classmethod
    def from_hf(cls, params: Mapping[str, Any] | None, theta: float | None) -> RopeConfig:
        """From a config's `rope_parameters` (transformers 5) or `rope_scaling` (older) dict and `rope_theta`."""
        p = dict(params or {})
        rope_type = p.get("rope_type") or p.get("type") or "default"
        kwargs: dict[str, Any] = {"rope_type": rope_type, "theta": float(p.get("rope_theta") or theta or 10000.0)}
        for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                    "attention_factor", "mscale", "mscale_all_dim"):
            if p.get(key) is not None:
                kwargs[key] = float(p[key])
        if p.get("original_max_position_embeddings") is not None:
            kwargs["original_max_position_embeddings"] = int(p["original_max_position_embeddings"])
        if p.get("truncate") is not None:
            kwargs["truncate"] = bool(p["truncate"])
        return cls(**kwargs)


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM2): RMSNorm, RoPE, GQA, SwiGLU."""

    arch: str = bounded("llama", "llama, mistral or qwen2 (they differ in biases and sliding windows)")
    num_layers: int = bounded(1, "decoder layers", 1, 1024)
    hidden_size: int = bounded(64, "width of the residual stream (H)", 1, 1 << 16)
    num_heads: int = bounded(1, "query heads", 1, 1024)
    num_kv_heads: int = bounded(1, "key/value heads; num_heads is a multiple (GQA)", 1, 1024)
    head_dim: int = bounded(64, "width of one attention head (D)", 1, 1024)
    intermediate_size: int = bounded(256, "width of the SwiGLU MLP", 1, 1 << 18)
    vocab_size: int = bounded(256, "rows of the embedding and the LM head (V)", 1, 1 << 22)
    max_position_embeddings: int = bounded(2048, "context length the model was trained for", 1, 1 << 24)
    rms_norm_eps: float = bounded(1e-6, "RMSNorm epsilon", 0.0, 1.0)
    rope: RopeConfig = field(default_factory=RopeConfig, metadata={"doc": "rotary embedding parameters"})
    tie_word_embeddings: bool = bounded(False, "the LM head is the embedding matrix (SmolLM2, small Qwen2)")
    qkv_bias: bool = bounded(False, "q/k/v projections have biases (Qwen2; Llama with attention_bias)")
    o_bias: bool = bounded(False, "the output projection has a bias (Llama with attention_bias)")
    mlp_bias: bool = bounded(False, "gate/up/down projections have biases (Llama with mlp_bias)")
    sliding_window: int = bounded(0, "attend to at most this many most recent positions; 0: no window", 0, 1 << 24)
    sliding_window_from_layer: int = bounded(0, "first layer that uses the window (Qwen2 max_window_layers)", 0)
    bos_token_id: int = bounded(-1, "beginning-of-sequence token; -1: none", -1)
    eos_token_ids: tuple[int, ...] = bounded((), "tokens that end a generation")
    checkpoint_dtype: str = bounded("float32", "dtype the weights are stored in (a default for the engine)")

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.arch not in ARCHS:
            raise ConfigError(f"unsupported architecture {self.arch!r} (supported: {ARCHS})", key="arch")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}", key="heads"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int, num_layers: int | None = None) -> int:
        """KV bytes one token takes on a stage holding `num_layers` layers (all layers by default)."""
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * self.kv_size * dtype_bytes * layers

    def layer_uses_window(self, layer: int) -> bool:
        return self.sliding_window > 0 and layer >= self.sliding_window_from_layer

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any], generation: Mapping[str, Any] | None = None) -> ModelConfig:
        """From the dict of a config.json (plus generation_config.json, which often has more EOS ids)."""
        arch = cfg.get("model_type", "")
        if arch not in ARCHS:
            raise ConfigError(f"model_type {arch!r} is not a Llama-family decoder we run (supported: {ARCHS})")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (SwiGLU needs silu)", key="hidden_act")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        window, window_from = 0, 0
        if arch == "mistral":
            window = int(cfg.get("sliding_window") or 0)
        elif arch == "qwen2" and cfg.get("use_sliding_window"):
            window = int(cfg.get("sliding_window") or 0)
            window_from = int(cfg.get("max_window_layers") or 0)
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            arch=arch,
            num_layers=int(cfg["num_hidden_layers"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(cfg.get("rope_parameters") or cfg.get("rope_scaling"), cfg.get("rope_theta")),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=arch == "llama" and attention_bias,
            mlp_bias=arch == "llama" and bool(cfg.get("mlp_bias", False)),
            sliding_window=window,
            sliding_window_from_layer=window_from,
            bos_token_id=_first_id(cfg.get("bos_token_id")),
            eos_token_ids=_ids(cfg.get("eos_token_id"), (generation or {}).get("eos_token_id")),
            checkpoint_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )

    @classmethod
    def from_hf_dir(cls, directory: Path) -> ModelConfig:
        try:
            cfg = json.loads((directory / "config.json").read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read config.json: {exc}", file=str(directory)) from exc
        gen_path = directory / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.exists() else None
        return cls.from_hf_dict(cfg, generation)


def _first_id(value: Any) -> int:
    if isinstance(value, list):
        return int(value[0]) if value else -1
    return -1 if value is None else int(value)


def _ids(*values: Any) -> tuple[int, ...]:
    """Token ids from several int / list / None values, in first-seen order without repeats."""
    out: list[int] = []
    for value in values:
        for token in value if isinstance(value, list) else [] if value is None else [value]:
            if int(token) not in out:
                out.append(int(token))
    return tuple(out)
