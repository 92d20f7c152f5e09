"""Reading one shard's weights, and nothing else, from a safetensors directory or a GGUF file.

A stage holding layers [first, last) reads those layers' tensors, plus the embedding on the first stage and
the final norm and LM head on the last (the embedding matrix again when embeddings are tied). Both formats are
memory-mapped, so the bytes that become resident are the bytes of the tensors read.

Projections that consume the same input are fused on load (q|k|v, gate|up), turning three and two matmuls
per layer into one each; that is the largest single saving in a decode step of a small model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from hetnode.errors import ConfigError
from hetnode.models.config import ModelConfig
from hetnode.models.gguf_file import GGUFTensors
from hetnode.models.resolve import is_gguf, resolve_model
from hetnode.node.engine.linear import Linear


class TensorSource(Protocol):
    """Tensors of a checkpoint under Hugging Face parameter names, read one at a time."""

    path: Path

    def has(self, name: str) -> bool: ...

    def get(self, name: str) -> torch.Tensor: ...


class SafetensorsTensors:
    """A Hugging Face directory: model.safetensors, or shards listed in model.safetensors.index.json."""

    def __init__(self, directory: Path) -> None:
        self.path = directory
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            self._files = {name: directory / file for name, file in weight_map.items()}
        elif (directory / "model.safetensors").is_file():
            with safe_open(directory / "model.safetensors", framework="pt") as f:
                self._files = dict.fromkeys(f.keys(), directory / "model.safetensors")
        else:
            raise ConfigError("no model.safetensors or model.safetensors.index.json", file=str(directory))

    def has(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str) -> torch.Tensor:
        with safe_open(self._files[name], framework="pt") as f:
            tensor: torch.Tensor = f.get_tensor(name)
        return tensor


def open_tensors(model: str | Path) -> tuple[ModelConfig, TensorSource]:
    path = resolve_model(model)
    if is_gguf(path):
        source = GGUFTensors(path)
        return source.config, source
    return ModelConfig.from_hf_dir(path), SafetensorsTensors(path)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # [Q + 2 * KV, H] (+ bias), rows q | k | v
    o: Linear  # [H, Q]
    post_norm: torch.Tensor  # [H]
    gate_up: Linear  # [2 * I, H], rows gate | up
    down: Linear  # [H, I]


@dataclass
class ShardWeights:
    layers: list[LayerWeights]
    embed: torch.Tensor | None = None  # [V, H], first stage
    final_norm: torch.Tensor | None = None  # [H], last stage
    lm_head: Linear | None = None  # [V, H], last stage
    names_read: list[str] = field(default_factory=list)  # checkpoint tensors this shard read, in order
    bytes_read: int = 0  # their size as stored after dequantization, before any dtype conversion

    def nbytes(self) -> int:
        """Bytes the shard's weights occupy on their device (a tensor shared by two roles counts once)."""
        dense: dict[int, int] = {}
        packed = 0
        tensors = [t for t in (self.embed, self.final_norm) if t is not None]
        linears = [self.lm_head] if self.lm_head is not None else []
        for layer in self.layers:
            tensors += [layer.input_norm, layer.post_norm]
            linears += [layer.qkv, layer.o, layer.gate_up, layer.down]
        for lin in linears:
            if lin.weight is None:
                packed += lin.nbytes
            else:
                tensors.append(lin.weight)
                if lin.bias is not None:
                    tensors.append(lin.bias)
        for t in tensors:
            dense[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return packed + sum(dense.values())


def load_shard(
    source: TensorSource,
    config: ModelConfig,
    first_layer: int,
    last_layer: int,
    *,
    device: torch.device,
    dtype: torch.dtype,
    pack: bool = True,
) -> ShardWeights:
    """Read layers [first_layer, last_layer), the embedding if first_layer == 0, the head if last.

    `pack=False` keeps plain weights for `F.linear` (see `linear.py`), for tests that compare the two.
    """
    if not 0 <= first_layer < last_layer <= config.num_layers:
        raise ConfigError(f"layer range [{first_layer}, {last_layer}) outside [0, {config.num_layers})")
    shard = ShardWeights(layers=[])

    def read(name: str) -> torch.Tensor:
        tensor = source.get(name)
        shard.names_read.append(name)
        shard.bytes_read += tensor.nbytes
        return tensor

    def put(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(device=device, dtype=dtype).contiguous()

    def cat(*names: str) -> torch.Tensor:
        return put(torch.cat([read(n) for n in names]))

    def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return Linear(weight, bias, pack=pack)

    for i in range(first_layer, last_layer):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv = [attn + f"{x}_proj" for x in "qkv"]
        gate_up = [mlp + "gate_proj", mlp + "up_proj"]
        shard.layers.append(
            LayerWeights(
                input_norm=put(read(p + "input_layernorm.weight")),
                qkv=linear(
                    cat(*(n + ".weight" for n in qkv)), cat(*(n + ".bias" for n in qkv)) if config.qkv_bias else None
                ),
                o=linear(put(read(attn + "o_proj.weight")), put(read(attn + "o_proj.bias")) if config.o_bias else None),
                post_norm=put(read(p + "post_attention_layernorm.weight")),
                gate_up=linear(
                    cat(*(n + ".weight" for n in gate_up)),
                    cat(*(n + ".bias" for n in gate_up)) if config.mlp_bias else None,
                ),
                down=linear(
                    put(read(mlp + "down_proj.weight")), put(read(mlp + "down_proj.bias")) if config.mlp_bias else None
                ),
            )
        )
    if first_layer == 0:
        shard.embed = put(read("model.embed_tokens.weight"))
    if last_layer == config.num_layers:
        shard.final_norm = put(read("model.norm.weight"))
        tied = config.tie_word_embeddings or not source.has("lm_head.weight")
        if tied and shard.embed is not None:
            # Packing copies the matrix: a one-stage model with tied embeddings holds it twice on CPU (the
            # dense copy for lookups), which buys a 2.8x faster LM head. Without packing it is shared.
            shard.lm_head = linear(shard.embed)
        else:
            shard.lm_head = linear(put(read("model.embed_tokens.weight" if tied else "lm_head.weight")))
    return shard
