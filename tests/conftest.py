"""Puts this folder on the import path, so tests share helpers such as `raw_peer`; and fixtures several folders use."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_transformers() -> Any:
    """transformers' SmolLM2-135M from the packaged GGUF, the reference our engine must match. Loaded once per
    run: reading the GGUF's metadata in pure Python takes ~25 s here, and five test modules compare against it."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers import logging as hf_logging

    from hetnode.models.resolve import resolve_model

    hf_logging.set_verbosity_error()
    path = resolve_model("smollm2-135m")
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
