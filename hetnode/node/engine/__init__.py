"""Model shards: the engine interface (`base`) and its PyTorch backend for Llama-family decoders."""

from hetnode.node.engine.base import Engine, EngineConfig, EngineError, ItemResult, LayerDone, StepItem
from hetnode.node.engine.pipeline import Completion, LocalPipeline, Request
from hetnode.node.engine.sampling import GREEDY, SamplingParams
from hetnode.node.engine.torch_engine import TorchEngine

__all__ = [
    "GREEDY",
    "Completion",
    "Engine",
    "EngineConfig",
    "EngineError",
    "ItemResult",
    "LayerDone",
    "LocalPipeline",
    "Request",
    "SamplingParams",
    "StepItem",
    "TorchEngine",
]
