"""Puts this folder on the import path, so tests share helpers such as `raw_peer`; and fixtures several folders use."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm2_transformers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """transformers' SmolLM2-135M from the packaged GGUF, the reference our engine must match. Loaded once per
    process: reading the GGUF's metadata in pure Python takes ~25 s here, and five test modules compare against it.
    The first process of a run converts it and saves it where the run's other processes (xdist) load it from, in
    about a second: the same float32 weights and config, read back."""
    import fcntl

    import torch
    from safetensors.torch import load_model, save_model
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers import logging as hf_logging

    from hetnode.models.resolve import resolve_model

    hf_logging.set_verbosity_error()
    path = resolve_model("smollm2-135m")
    stat = path.stat()
    # Shared by this run's workers (each has its own basetemp below it); named by the GGUF it came from.
    saved = tmp_path_factory.getbasetemp().parent / f"smollm2-transformers-{stat.st_size}-{stat.st_mtime_ns}"
    with open(f"{saved}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (saved / "model.safetensors").exists():
            model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
            # save_pretrained refuses a model loaded from a GGUF: the config and the tensors, each on its own.
            partial = saved.with_name(saved.name + ".partial")
            model.config.save_pretrained(partial)
            save_model(model, str(partial / "model.safetensors"))
            partial.rename(saved)
            return model.eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(saved)), dtype=torch.float32)
    load_model(model, str(saved / "model.safetensors"))
    return model.eval()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The multi-process tests first, in their order: they are the longest, and where two processes share the slow
    tests one of them started last runs on alone at the end while the other process has nothing left to do."""
    items.sort(key=lambda item: not item.path.name.endswith("_multiprocess.py"))
