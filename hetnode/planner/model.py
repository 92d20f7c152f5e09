"""Model specs for planning: the shape numbers that decide memory per layer and bytes per activation.

A planner does not need weights, only how big a layer is, how much KV a token leaves per layer and how many
bytes one token's activation takes on the wire. Presets cover the papers' models; a TOML or JSON file with
the same keys describes any other (docs/planner.md has the format)::

    name = "my-model"
    num_layers = 32
    hidden_size = 4096
    intermediate_size = 14336
    num_heads = 32
    num_kv_heads = 8
    vocab_size = 128256
    bytes_per_param = 2          # optional, default 2 (fp16)
    bytes_per_activation = 2     # optional, default 2
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hetnode.errors import ConfigError
from hetnode.planner.costmodel import LayerShape

TOKEN_BYTES = 4  # a token id on the wire between the coordinator and a node (int32)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int = 0  # 0: hidden_size // num_heads
    bytes_per_param: float = 2.0
    bytes_per_activation: float = 2.0

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_heads, 1))

    @property
    def shape(self) -> LayerShape:
        return LayerShape(hidden=self.hidden_size, intermediate=self.intermediate_size, heads=self.num_heads,
                          kv_heads=self.num_kv_heads, head_dim=self.head_dim)

    @property
    def layer_params(self) -> int:
        return self.shape.params

    @property
    def layer_bytes(self) -> float:
        """Weight bytes of one transformer layer."""
        return self.layer_params * self.bytes_per_param

    @property
    def activation_bytes(self) -> float:
        """Bytes one token's hidden state takes between two stages."""
        return self.hidden_size * self.bytes_per_activation

    @property
    def kv_bytes_per_token_layer(self) -> float:
        """KV bytes one token of context keeps in one layer (K and V, 16-bit)."""
        return 2 * self.num_kv_heads * self.head_dim * 2

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("llama-30b", 60, 6656, 17920, 52, 52, 32000),  # LLaMA-1 30B (Helix's "LLaMA 30B")
        ModelSpec("llama-70b", 80, 8192, 28672, 64, 8, 32000),  # LLaMA-2 70B
        ModelSpec("llama3-8b", 32, 4096, 14336, 32, 8, 128256),
        ModelSpec("qwen2-7b", 28, 3584, 18944, 28, 4, 152064),
        # EcoServe's models (§4.1), from their Hugging Face config.json files.
        ModelSpec("codellama-34b", 48, 8192, 22016, 64, 8, 32000),  # CodeLlama-34B (GQA)
        ModelSpec("qwen2-72b", 80, 8192, 29568, 64, 8, 152064),  # Qwen2-72B (GQA)
        ModelSpec("smollm2-135m", 30, 576, 1536, 9, 3, 49152),
    )
}
ALIASES = {"llama1-30b": "llama-30b", "llama2-70b": "llama-70b", "llama-2-70b": "llama-70b",
           "llama-1-30b": "llama-30b", "llama-3-8b": "llama3-8b", "smollm2": "smollm2-135m"}

_INT_KEYS = ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "vocab_size")
_FLOAT_KEYS = ("bytes_per_param", "bytes_per_activation")


def model_names() -> list[str]:
    return sorted(PRESETS)


def model_spec(name_or_path: str) -> ModelSpec:
    """A preset by name (case-insensitive), or a TOML/JSON model file by path."""
    key = name_or_path.strip().lower()
    key = ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    if name_or_path.endswith((".toml", ".json")) or Path(name_or_path).is_file():
        return load_model_spec(name_or_path)
    raise ConfigError(f"unknown model {name_or_path!r}; presets: {', '.join(model_names())} (or a .toml/.json file)")


def load_model_spec(path: str | Path) -> ModelSpec:
    source = str(path)
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read model file: {exc.strerror or exc}", file=source) from exc
    try:
        data = json.loads(raw) if source.endswith(".json") else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(f"invalid {'JSON' if source.endswith('.json') else 'TOML'}: {exc}", file=source) from exc
    return parse_model_spec(data, source)


def parse_model_spec(data: object, source: str) -> ModelSpec:
    if not isinstance(data, Mapping):
        raise ConfigError("a model file must be a table of keys", file=source)
    allowed = {"name", "head_dim", *_INT_KEYS, *_FLOAT_KEYS}
    for k in data:
        if k not in allowed:
            raise ConfigError(f"unknown key (allowed: {', '.join(sorted(allowed))})", file=source, key=str(k))
    for k in ("name", *_INT_KEYS):
        if k not in data:
            raise ConfigError("missing required key", file=source, key=k)
    if not isinstance(data["name"], str) or not data["name"]:
        raise ConfigError("must be a non-empty string", file=source, key="name")
    values: dict[str, Any] = {"name": data["name"]}
    for k in (*_INT_KEYS, "head_dim"):
        if k not in data:
            continue
        v = data[k]
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if k == "head_dim" else 1):
            raise ConfigError(f"must be a positive integer, not {v!r}", file=source, key=k)
        values[k] = v
    for k in _FLOAT_KEYS:
        if k not in data:
            continue
        v = data[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"must be a positive number, not {v!r}", file=source, key=k)
        values[k] = float(v)
    if values["num_heads"] % values["num_kv_heads"]:
        raise ConfigError("num_heads must be a multiple of num_kv_heads", file=source, key="num_kv_heads")
    return ModelSpec(**values)


def from_model_config(name: str, cfg: Any, *, bytes_per_param: float = 2.0) -> ModelSpec:
    """The spec of a loaded model's config (hetnode.models.config.ModelConfig)."""
    return ModelSpec(name=name, num_layers=cfg.num_layers, hidden_size=cfg.hidden_size,
                     intermediate_size=cfg.intermediate_size, num_heads=cfg.num_heads,
                     num_kv_heads=cfg.num_kv_heads, vocab_size=cfg.vocab_size, head_dim=cfg.head_dim,
                     bytes_per_param=bytes_per_param)
