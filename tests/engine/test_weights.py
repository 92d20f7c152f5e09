"""A shard reads its own layers' tensors and nothing else; dtypes and devices; GGUF's Q/K layout."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from engine_helpers import sessions
from safetensors import safe_open

from hetnode.errors import ConfigError
from hetnode.models import resolve_model
from hetnode.models.gguf_file import gguf_name, unpermute_qk
from hetnode.node.engine import EngineConfig, SamplingParams, StepItem, TorchEngine
from hetnode.node.engine.weights import load_shard, open_tensors

SMALL = EngineConfig(num_kv_blocks=32)


def _stored(path: Path) -> dict[str, int]:
    """Tensor name -> bytes, straight from the safetensors files."""
    out = {}
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[name] = f.get_tensor(name).nbytes
    return out


def _layer_names(names: dict[str, int], layers: range) -> set[str]:
    return {n for n in names if any(n.startswith(f"model.layers.{i}.") for i in layers)}


@pytest.mark.parametrize(("first", "last"), [(0, 2), (2, 4), (4, 5), (0, 5)])
def test_shard_reads_exactly_its_tensors(tiny_llama: Path, first: int, last: int) -> None:
    stored = _stored(tiny_llama)
    config, source = open_tensors(tiny_llama)
    shard = load_shard(source, config, first, last, device=torch.device("cpu"), dtype=torch.float32)
    expected = _layer_names(stored, range(first, last))
    if first == 0:
        expected.add("model.embed_tokens.weight")
    if last == 5:
        expected |= {"model.norm.weight", "lm_head.weight"}
    assert sorted(shard.names_read) == sorted(expected)
    assert shard.bytes_read == sum(stored[n] for n in expected)


def test_tied_last_stage_reads_the_embedding_as_lm_head(tiny_qwen2: Path) -> None:
    config, source = open_tensors(tiny_qwen2)
    assert config.tie_word_embeddings and not source.has("lm_head.weight")
    shard = load_shard(source, config, 3, 5, device=torch.device("cpu"), dtype=torch.float32)
    assert "model.embed_tokens.weight" in shard.names_read and shard.embed is None
    whole = load_shard(source, config, 0, 5, device=torch.device("cpu"), dtype=torch.float32)
    assert whole.names_read.count("model.embed_tokens.weight") == 1


def test_resident_weights_grow_with_layers_held(tiny_llama: Path) -> None:
    one = TorchEngine.load(tiny_llama, 1, 2, engine_config=SMALL).weight_bytes()
    three = TorchEngine.load(tiny_llama, 1, 4, engine_config=SMALL).weight_bytes()
    assert three == 3 * one
    assert TorchEngine.load(tiny_llama, 0, 5, engine_config=SMALL).weight_bytes() > 5 * one  # plus embedding and head


def test_packed_and_plain_linears_agree(tiny_llama: Path) -> None:
    config, source = open_tensors(tiny_llama)
    logits = []
    for pack in (True, False):
        weights = load_shard(source, config, 0, 5, device=torch.device("cpu"), dtype=torch.float32, pack=pack)
        cpu = torch.device("cpu")
        engine = TorchEngine(config, weights, 0, 5, device=cpu, dtype=torch.float32, engine_config=SMALL)
        params = SamplingParams(return_logits=True)
        [r] = engine.step([StepItem(sessions(1)[0], 0, token_ids=[5, 6, 7], sampling=params)])
        logits.append(r.logits)
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=0)


def test_bfloat16_on_cpu_tracks_float32(tiny_llama: Path) -> None:
    params = SamplingParams(return_logits=True)
    out = {}
    for dtype in ("float32", "bfloat16"):
        engine = TorchEngine.load(tiny_llama, dtype=dtype, engine_config=SMALL)
        [r] = engine.step([StepItem(sessions(1)[0], 0, token_ids=[40, 50, 60, 70], sampling=params)])
        out[dtype] = r
    assert out["bfloat16"].logits is not None and out["float32"].logits is not None
    # bfloat16 keeps 8 mantissa bits: logits of magnitude ~10 move by a few tenths over 5 layers.
    torch.testing.assert_close(out["bfloat16"].logits, out["float32"].logits, atol=0.5, rtol=0.05)
    assert out["bfloat16"].token == out["float32"].token


def test_unsupported_dtype_and_missing_cuda_are_config_errors(tiny_llama: Path) -> None:
    with pytest.raises(ConfigError, match="not supported on CPU"):
        TorchEngine.load(tiny_llama, dtype="float16")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="CUDA is not available"):
            TorchEngine.load(tiny_llama, device="cuda")
    with pytest.raises(ConfigError):
        TorchEngine.load(tiny_llama, 3, 9)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_half_precision_tracks_cpu_float32(tiny_llama: Path, dtype: str) -> None:
    params = SamplingParams(return_logits=True)
    prompt = StepItem(sessions(1)[0], 0, token_ids=[40, 50, 60], sampling=params)
    ref = TorchEngine.load(tiny_llama, engine_config=SMALL).step([prompt])
    gpu = TorchEngine.load(tiny_llama, device="cuda", dtype=dtype, engine_config=EngineConfig(num_kv_blocks=64))
    out = gpu.step([prompt])
    assert out[0].logits is not None and ref[0].logits is not None
    torch.testing.assert_close(out[0].logits.cpu(), ref[0].logits, atol=0.5, rtol=0.05)
    decode = gpu.step([StepItem(sessions(1)[0], 3, token_ids=[out[0].token or 0], sampling=params)])
    assert decode[0].token is not None
    assert gpu.release(sessions(1)[0]) > 0


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    # What convert_hf_to_gguf.py does to Q and K rows of llama models.
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permutation(heads: int) -> None:
    w = np.random.default_rng(0).standard_normal((heads * 8, 5)).astype(np.float32)
    assert np.array_equal(unpermute_qk(_llama_cpp_permute(w, heads), heads), w)
    # Within a head, GGUF interleaves the two rotary halves: row 2i is HF row i, row 2i+1 is HF row i + D/2.
    assert np.array_equal(_llama_cpp_permute(w, heads)[1], w[4])


def test_gguf_names() -> None:
    assert gguf_name("model.layers.7.self_attn.q_proj.weight") == "blk.7.attn_q.weight"
    assert gguf_name("model.layers.0.post_attention_layernorm.weight") == "blk.0.ffn_norm.weight"
    assert gguf_name("lm_head.weight") == "output.weight"
    with pytest.raises(KeyError):
        gguf_name("model.layers.0.rotary_emb.inv_freq")


def test_gguf_middle_shard_reads_only_its_layers_and_stays_small() -> None:
    path = resolve_model("smollm2-135m")
    config, source = open_tensors(path)
    gc.collect()
    rss = psutil.Process().memory_info().rss
    shard = load_shard(source, config, 10, 13, device=torch.device("cpu"), dtype=torch.float32)
    grown = psutil.Process().memory_info().rss - rss
    assert {n.split(".")[2] for n in shard.names_read} == {"10", "11", "12"}
    assert len(shard.names_read) == 3 * 9
    h, i = config.hidden_size, config.intermediate_size
    layer_params = h * (config.q_size + 2 * config.kv_size) + config.q_size * h + 3 * h * i + 2 * h
    full_fp32 = 4 * (config.vocab_size * h + config.num_layers * layer_params)
    assert shard.nbytes() < full_fp32 / 8
    # Resident memory follows the shard (3 of 30 layers, ~42 MB), not the whole model (~540 MB in float32).
    assert grown < full_fp32 / 4, f"RSS grew by {grown / 1e6:.0f} MB"
