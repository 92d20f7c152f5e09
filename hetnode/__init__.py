"""hetnode: peer-to-peer LLM serving on heterogeneous GPUs across regions."""

__version__ = "0.1.0"
