"""The PyTorch engine for Llama-family decoders, on CPU (float32, bfloat16) or CUDA (float16, bfloat16)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from hetnode.errors import ConfigError
from hetnode.ids import SessionId
from hetnode.kv import KVPool, KVUsage, Span
from hetnode.models.config import ModelConfig
from hetnode.node.engine.attention import AttentionPlan
from hetnode.node.engine.base import Engine, EngineConfig, EngineError, ItemResult, LayerDone, StepItem
from hetnode.node.engine.kv_cache import PagedKVCache, bytes_per_block
from hetnode.node.engine.model import DecoderStack, rms_norm
from hetnode.node.engine.rope import Rotary
from hetnode.node.engine.sampling import sample
from hetnode.node.engine.weights import ShardWeights, load_shard, open_tensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_DTYPES = (torch.float32, torch.bfloat16)


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A supported compute dtype: float32 by default on CPU, bfloat16 on CUDA."""
    if dtype is None:
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ConfigError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})", key="dtype")
        dtype = DTYPES[dtype]
    if device.type == "cpu" and dtype not in _CPU_DTYPES:
        # float16 matmuls on CPU are emulated and many times slower than float32.
        raise ConfigError(f"{dtype} is not supported on CPU; use float32 or bfloat16", key="dtype")
    return dtype


class TorchEngine(Engine):
    """Layers [first_layer, last_layer) of a Llama, Mistral, Qwen2 or SmolLM2 model."""

    def __init__(
        self,
        config: ModelConfig,
        weights: ShardWeights,
        first_layer: int,
        last_layer: int,
        *,
        device: torch.device,
        dtype: torch.dtype,
        engine_config: EngineConfig | None = None,
    ) -> None:
        self.config = config
        self.engine_config = engine_config or EngineConfig()
        self.first_layer, self.last_layer = first_layer, last_layer
        self.device, self.dtype = device, dtype
        self.weights = weights
        ec = self.engine_config
        num_layers = last_layer - first_layer
        blocks = ec.num_kv_blocks or ec.kv_cache_bytes // bytes_per_block(config, num_layers, ec.block_size, dtype)
        if blocks < 1:
            raise ConfigError(f"kv_cache_bytes {ec.kv_cache_bytes} holds no block of {ec.block_size} tokens")
        self.kv = PagedKVCache(config, num_layers, blocks, ec.block_size, device=device, dtype=dtype)
        self.pool = KVPool(blocks, ec.block_size)
        self.stack = DecoderStack(config, weights.layers, first_layer, self.kv)
        self.rotary = Rotary(config, device)

    @classmethod
    def load(
        cls,
        model: str | Path,
        first_layer: int = 0,
        last_layer: int | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        engine_config: EngineConfig | None = None,
    ) -> TorchEngine:
        """Load layers [first_layer, last_layer) (default: to the end) of a preset, .gguf or HF directory."""
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {dev} requested but CUDA is not available", key="device")
        compute = parse_dtype(dtype, dev)
        config, source = open_tensors(model)
        last = config.num_layers if last_layer is None else last_layer
        weights = load_shard(source, config, first_layer, last, device=dev, dtype=compute)
        return cls(config, weights, first_layer, last, device=dev, dtype=compute, engine_config=engine_config)

    # -- the step ---------------------------------------------------------------------------------------

    def step(self, items: Sequence[StepItem], layer_done: LayerDone | None = None) -> list[ItemResult]:
        self.validate(items)
        # Decode items first: the attention plan then treats them as one contiguous block of rows.
        order = sorted(range(len(items)), key=lambda i: not _is_decode(items[i]))
        ordered = [items[i] for i in order]
        try:
            growth = self.pool.grow([Span(it.session, it.start, it.num_tokens) for it in ordered])
        except ValueError as exc:
            raise EngineError(str(exc)) from exc
        saved = None
        try:
            with torch.inference_mode():
                # A rewind writes over tokens its session still holds until the step commits: keep them.
                if growth.overwritten:
                    saved = self.kv.save(growth.overwritten)
                results = self._run(ordered, growth.slots, layer_done)
        except BaseException:
            try:
                if saved is not None:
                    with torch.inference_mode():
                        self.kv.load(saved)
            finally:
                growth.rollback()
            raise
        growth.commit()
        out: list[ItemResult] = [results[0]] * len(items)
        for pos, i in enumerate(order):
            out[i] = results[pos]
        return out

    def _run(self, items: list[StepItem], slots: list[list[int]], layer_done: LayerDone | None) -> list[ItemResult]:
        dev = self.device
        decode: list[tuple[int, Sequence[int]]] = []
        prefill: list[tuple[int, int, Sequence[int]]] = []
        for it in items:
            table = self.pool.lease(it.session).blocks
            if _is_decode(it):
                decode.append((it.start, table))
            else:
                prefill.append((it.start, it.num_tokens, table))
        plan = AttentionPlan(
            decode, prefill, block_size=self.pool.block_size, window=self.config.sliding_window, device=dev
        )
        positions = torch.tensor([p for it in items for p in it.positions], dtype=torch.long, device=dev)
        slot_ids = torch.tensor([s for item_slots in slots for s in item_slots], dtype=torch.long, device=dev)
        segments = [(it.num_tokens, it.start + it.num_tokens) for it in items]
        cos, sin = self.rotary.cos_sin(positions, segments, self.dtype)

        if self.is_first:
            assert self.weights.embed is not None
            ids = torch.tensor([t for it in items for t in it.token_ids or ()], dtype=torch.long, device=dev)
            x = F.embedding(ids, self.weights.embed)  # [T, H]
        else:
            x = torch.cat([it.hidden for it in items if it.hidden is not None]).to(device=dev, dtype=self.dtype)
        x = self.stack.forward(x, cos, sin, slot_ids, plan, layer_done)  # [T, H]

        if not self.is_last:
            rows = _row_offsets(items)
            return [
                ItemResult(it.session, hidden=x[r : r + it.num_tokens]) for it, r in zip(items, rows, strict=True)
            ]
        return self._sample(items, x)

    def _sample(self, items: list[StepItem], x: torch.Tensor) -> list[ItemResult]:
        # Only the last position of an item that asked to sample goes through the norm and LM head.
        wanted = [i for i, it in enumerate(items) if it.sampling is not None]
        results = [ItemResult(it.session) for it in items]
        if not wanted:
            return results
        offsets = _row_offsets(items)
        last_rows = torch.tensor(
            [offsets[i] + items[i].num_tokens - 1 for i in wanted], dtype=torch.long, device=self.device
        )
        assert self.weights.final_norm is not None and self.weights.lm_head is not None
        h = rms_norm(x[last_rows], self.weights.final_norm, self.config.rms_norm_eps)
        logits = self.weights.lm_head(h).float()  # [N, V]
        params = [items[i].sampling for i in wanted]
        draws = sample(
            logits,
            [p for p in params if p is not None],
            [items[i].start + items[i].num_tokens for i in wanted],
        )
        for i, draw in zip(wanted, draws, strict=True):
            p = items[i].sampling
            assert p is not None
            results[i] = ItemResult(
                items[i].session,
                token=draw.token,
                logprob=draw.logprob,
                top_logprobs=draw.top_logprobs,
                logits=draw.logits,
                stopped=draw.token in p.stop_token_ids,
            )
        return results

    # -- KV and lifecycle ---------------------------------------------------------------------------------

    def release(self, session: SessionId) -> int:
        return self.pool.release(session)

    def blocks_needed(self, items: Sequence[StepItem]) -> int:
        try:
            return self.pool.blocks_needed([Span(it.session, it.start, it.num_tokens) for it in items])
        except ValueError as exc:
            raise EngineError(str(exc)) from exc

    def kv_usage(self) -> KVUsage:
        return self.pool.usage()

    def export_kv(self, session: SessionId, start: int, end: int,
                  layers: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = layers if layers is not None else (self.first_layer, self.last_layer)
        if not self.first_layer <= a < b <= self.last_layer:
            raise EngineError(f"session {session}: KV of layers [{a}, {b}) asked of a node holding "
                              f"[{self.first_layer}, {self.last_layer})")
        index = self._kv_slots(session, start, end - start)
        lo, hi = a - self.first_layer, b - self.first_layer
        with torch.no_grad():  # not inference mode: the copies are the caller's, to pack or change in place
            return (PagedKVCache.flat(self.kv.keys)[lo:hi].index_select(1, index),
                    PagedKVCache.flat(self.kv.values)[lo:hi].index_select(1, index))

    def reserve_kv(self, session: SessionId, tokens: int) -> None:
        if session in self.pool:
            raise EngineError(f"session {session} already holds KV here")
        if tokens < 1:
            raise EngineError(f"session {session}: cannot reserve {tokens} tokens")
        self.pool.grow([Span(session, 0, tokens)]).commit()

    def import_kv(self, session: SessionId, start: int, first_layer: int, keys: torch.Tensor,
                  values: torch.Tensor) -> None:
        layers, count = keys.shape[0], keys.shape[1] if keys.dim() == 4 else 0
        shape = (layers, count, self.config.num_kv_heads, self.config.head_dim)
        if keys.dim() != 4 or tuple(keys.shape) != shape or tuple(values.shape) != shape or count < 1:
            raise EngineError(f"session {session}: KV of shapes {tuple(keys.shape)} and {tuple(values.shape)}, "
                              f"expected [layers, tokens >= 1, {shape[2]}, {shape[3]}] each")
        if not self.first_layer <= first_layer < first_layer + layers <= self.last_layer:
            raise EngineError(f"session {session}: KV of layers [{first_layer}, {first_layer + layers}) on a node "
                              f"holding [{self.first_layer}, {self.last_layer})")
        index = self._kv_slots(session, start, count)
        lo = first_layer - self.first_layer
        with torch.inference_mode():
            PagedKVCache.flat(self.kv.keys)[lo:lo + layers].index_copy_(1, index, keys.to(self.dtype))
            PagedKVCache.flat(self.kv.values)[lo:lo + layers].index_copy_(1, index, values.to(self.dtype))

    def _kv_slots(self, session: SessionId, start: int, count: int) -> torch.Tensor:
        lease = self.pool.get(session)
        if lease is None:
            raise EngineError(f"session {session} holds no KV here")
        if start < 0 or count < 1 or start + count > lease.num_tokens:
            raise EngineError(f"session {session} holds {lease.num_tokens} tokens here, not positions "
                              f"[{start}, {start + count})")
        return torch.tensor(lease.slots(start, count), dtype=torch.long, device=self.device)

    def weight_bytes(self) -> int:
        return self.weights.nbytes()

    def close(self) -> None:
        self.pool.release_all()
        self.weights = ShardWeights(layers=[])
        self.stack.layers = []
        self.kv.keys = self.kv.values = torch.empty(0)


def _is_decode(item: StepItem) -> bool:
    """One new token after cached context: such items share one attention call per layer."""
    return item.num_tokens == 1 and item.start > 0


def _row_offsets(items: Sequence[StepItem]) -> list[int]:
    offsets, row = [], 0
    for it in items:
        offsets.append(row)
        row += it.num_tokens
    return offsets
