"""Tokenizer and chat template of a model, with the slow GGUF conversion cached on disk.

transformers can build a tokenizer from a GGUF file, but it parses the whole vocabulary and merge list on
every call (several seconds for SmolLM2). We convert once and keep the result as ordinary Hugging Face
tokenizer files under `cache_dir("tokenizers")`, keyed by the GGUF file's name, size and mtime.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from hetnode.models.resolve import cache_dir, is_gguf, resolve_model


def tokenizer_cache_path(gguf_path: Path) -> Path:
    stat = gguf_path.stat()
    return cache_dir("tokenizers") / f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def load_tokenizer(model: str | Path, *, progress: bool = True) -> PreTrainedTokenizerBase:
    """The tokenizer (with its chat template) of a preset, .gguf file or Hugging Face directory."""
    path = resolve_model(model)
    if not is_gguf(path):
        return AutoTokenizer.from_pretrained(str(path))
    cached = tokenizer_cache_path(path)
    if (cached / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    with tqdm(total=2, desc=f"tokenizer from {path.name}", unit="step", disable=not progress) as bar:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        bar.update()
        # Write next to the final place and rename, so that testnet nodes starting together never read a
        # half-written directory; the loser of a race throws its copy away.
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cached.parent))
        try:
            tokenizer.save_pretrained(str(tmp))
            os.replace(tmp, cached)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
        bar.update()
    return tokenizer


def chat_prompt_ids(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of `messages` rendered with the tokenizer's chat template."""
    out = tokenizer.apply_chat_template(
        [dict(m) for m in messages], add_generation_prompt=add_generation_prompt, tokenize=True
    )
    # transformers 5 returns a BatchEncoding here; 4.x returned the list itself.
    ids: Sequence[int] = out["input_ids"] if isinstance(out, Mapping) else out  # type: ignore[assignment]
    return [int(t) for t in ids]
