"""The engine interface: one stage of a pipeline, holding layers [first_layer, last_layer) of a model.

The node's batch loop (and nothing else) drives it, from one worker thread per device:

    engine = TorchEngine.load("smollm2-135m", first_layer=0, last_layer=10)
    results = engine.step([StepItem(session, start=0, token_ids=prompt), ...])   # many sessions at once
    engine.release(session)                                                     # on every exit path

A step is synchronous and batched: it carries prefill chunks (n > 1 tokens) and decode items (n == 1) of many
sessions, each at positions [start, start + n). The first stage embeds token ids; later stages take the
hidden states the previous stage returned; the last stage applies the final norm and LM head and samples.
Each stage keeps the KV of its own layers for every session it has seen, in paged blocks (`hetnode.kv`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hetnode.errors import HetnodeError
from hetnode.ids import SessionId
from hetnode.kv import KVUsage
from hetnode.models.config import ModelConfig, bounded, check_bounds
from hetnode.node.engine.sampling import SamplingParams

LayerDone = Callable[[int], None]
"""A step's per-layer hook: called with a layer's index in the model (not in the shard) once the step has run that
layer, so its keys and values (and every earlier layer's here) are in the cache, readable with `export_kv`. It
runs in the step's thread between two layers (keep it short) and must not change the engine. Layer-wise KV
streaming (Splitwise §IV-C) sends each layer to the next phase from here while the forward goes on."""


class EngineError(HetnodeError):
    """A step that this stage cannot run as asked: wrong inputs for its position in the pipeline, a gap in a
    session's positions, too many tokens. Nothing changed; the caller should fail the affected requests."""


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine instance (the model's own shape is `ModelConfig`)."""

    block_size: int = bounded(16, "tokens per KV block", 1, 1024)
    kv_cache_bytes: int = bounded(256 << 20, "memory for this stage's KV blocks (all its layers)", 1, 1 << 44)
    num_kv_blocks: int = bounded(0, "KV blocks; 0 derives the count from kv_cache_bytes", 0, 1 << 24)
    max_batch_tokens: int = bounded(8192, "most tokens one step may carry (bounds activation memory)", 1, 1 << 20)

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True, slots=True)
class StepItem:
    """One session's share of a step: `num_tokens` tokens at positions [start, start + num_tokens).

    `start` must not exceed the tokens this stage already holds for the session; a smaller `start` rewinds
    the session's KV to it first (a retry after a downstream failure, a rejected speculative token).
    """

    session: SessionId
    start: int
    token_ids: Sequence[int] | None = None  # first stage: [n]
    hidden: torch.Tensor | None = None  # later stages: [n, H], as the previous stage returned it
    sampling: SamplingParams | None = None  # last stage: sample after this item; None for a non-final chunk

    @property
    def num_tokens(self) -> int:
        if self.token_ids is not None:
            return len(self.token_ids)
        return int(self.hidden.shape[0]) if self.hidden is not None else 0

    @property
    def positions(self) -> range:
        return range(self.start, self.start + self.num_tokens)


@dataclass(frozen=True, slots=True)
class ItemResult:
    """What a step produced for one item, in the order of the items."""

    session: SessionId
    hidden: torch.Tensor | None = None  # non-last stages: [n, H], for the next stage
    token: int | None = None  # last stage, when the item asked to sample
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    logits: torch.Tensor | None = None  # [V] float32, when sampling.return_logits
    stopped: bool = False  # `token` is one of sampling.stop_token_ids


class Engine(ABC):
    """One pipeline stage. Not thread-safe: one worker thread calls everything."""

    config: ModelConfig
    engine_config: EngineConfig
    first_layer: int
    last_layer: int  # exclusive

    @property
    def is_first(self) -> bool:
        return self.first_layer == 0

    @property
    def is_last(self) -> bool:
        return self.last_layer == self.config.num_layers

    @abstractmethod
    def step(self, items: Sequence[StepItem], layer_done: LayerDone | None = None) -> list[ItemResult]:
        """Run every item through this stage's layers in one batch, calling `layer_done` after each layer.

        Raises `EngineError` for malformed input and `hetnode.kv.KVCacheFull` when the new tokens do not fit,
        both before any layer runs; either way (and on any other exception, the hook's included) no session's KV
        changes. What the hook already did with the KV it read (sent it) is the hook's to undo.
        """

    @abstractmethod
    def release(self, session: SessionId) -> int:
        """Free the session's KV blocks; returns how many. Unknown or already released sessions: 0."""

    @abstractmethod
    def blocks_needed(self, items: Sequence[StepItem]) -> int:
        """Free KV blocks `step(items)` needs, so a batch loop can admit work that fits. Blocks a rewind gives
        back return only when its step succeeds (a failed step must find them intact), so they do not count."""

    @abstractmethod
    def kv_usage(self) -> KVUsage: ...

    # -- KV hand-offs between nodes: keys and values as [layers, tokens, KV heads, head_dim] tensors ----------

    @abstractmethod
    def export_kv(self, session: SessionId, start: int, end: int,
                  layers: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the session's keys and values at positions [start, end) in layers [a, b) of the model
        (`layers`; every layer this engine holds by default). Inside a step (from its `layer_done` hook) the
        step's own positions are readable in every layer it has run."""

    @abstractmethod
    def reserve_kv(self, session: SessionId, tokens: int) -> None:
        """Hold KV for positions [0, tokens) of a new session whose values will come from another node
        (`import_kv`); from then on the session holds `tokens` tokens, as if a step had run them. All or
        nothing: `KVCacheFull` when the pool cannot hold them, `EngineError` if the session exists."""

    @abstractmethod
    def import_kv(self, session: SessionId, start: int, first_layer: int, keys: torch.Tensor,
                  values: torch.Tensor) -> None:
        """Write keys and values [L, T, KV heads, head_dim] of layers [first_layer, first_layer + L) at positions
        [start, start + T) of a session that holds them (reserved). `EngineError` for anything out of place;
        nothing is written then."""

    @abstractmethod
    def close(self) -> None:
        """Release every session and drop the weights; the engine is unusable afterwards."""

    def validate(self, items: Sequence[StepItem]) -> None:
        """The checks every implementation makes before touching any state."""
        if not items:
            raise EngineError("a step needs at least one item")
        seen: set[SessionId] = set()
        total = 0
        for item in items:
            if item.session in seen:
                raise EngineError(f"session {item.session} appears twice in one step")
            seen.add(item.session)
            n = item.num_tokens
            if n < 1 or item.start < 0:
                raise EngineError(f"session {item.session}: empty item or negative start")
            total += n
            if self.is_first:
                if item.token_ids is None or item.hidden is not None:
                    raise EngineError(f"session {item.session}: the first stage takes token ids, not hidden states")
                if min(item.token_ids) < 0 or max(item.token_ids) >= self.config.vocab_size:
                    raise EngineError(f"session {item.session}: token id outside [0, {self.config.vocab_size})")
            elif item.hidden is None or item.token_ids is not None:
                raise EngineError(f"session {item.session}: stage at layer {self.first_layer} takes hidden states")
            elif item.hidden.dim() != 2 or item.hidden.shape[1] != self.config.hidden_size:
                raise EngineError(
                    f"session {item.session}: hidden states of shape {tuple(item.hidden.shape)}, "
                    f"expected [n, {self.config.hidden_size}]"
                )
        if total > self.engine_config.max_batch_tokens:
            raise EngineError(f"step of {total} tokens exceeds max_batch_tokens {self.engine_config.max_batch_tokens}")
