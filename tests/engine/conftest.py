"""Tiny models written once per test session (fixtures); helpers live in engine_helpers.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hetnode.models.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """tiny_dir(arch, **overrides) -> a tiny model directory, written once per distinct arguments."""
    made: dict[str, Path] = {}

    def make(arch: str = "llama", **overrides: Any) -> Path:
        key = f"{arch}-{sorted(overrides.items())!r}"
        if key not in made:
            made[key] = write_tiny_model(tmp_path_factory.mktemp(arch), arch, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def tiny_llama(tiny_dir: Callable[..., Path]) -> Path:
    return tiny_dir("llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_dir: Callable[..., Path]) -> Path:
    return tiny_dir("qwen2", shards=2)  # also exercises model.safetensors.index.json
