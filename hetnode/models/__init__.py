"""Models: resolving a name to files, their configs, tokenizers, and tiny random models for tests."""

from hetnode.models.config import ModelConfig, RopeConfig
from hetnode.models.resolve import DEFAULT_MODEL, PRESETS, cache_dir, load_config, resolve_model

__all__ = ["DEFAULT_MODEL", "PRESETS", "ModelConfig", "RopeConfig", "cache_dir", "load_config", "resolve_model"]
