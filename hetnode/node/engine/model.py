"""The decoder layer of the Llama family, on a flat batch of tokens from many sessions.

x: [T, H] holds every token of the step (all sessions, decode items first). Apart from attention, which
needs per-session context (`attention.py`), every operation is position-wise, so one kernel serves the whole
batch. Norms and the rotation follow transformers' operation order so that float32 results agree closely.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hetnode.models.config import ModelConfig
from hetnode.node.engine.attention import AttentionPlan, paged_attention
from hetnode.node.engine.kv_cache import PagedKVCache
from hetnode.node.engine.weights import LayerWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, H]; the statistics are taken in float32 whatever the compute dtype, as the reference does.
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, N, D]; cos, sin: [T, 1, D]. Rotate-half layout: dimension i pairs with i + D/2.
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderStack:
    """Layers [first, last) of a model over one paged KV cache."""

    def __init__(self, config: ModelConfig, layers: list[LayerWeights], first_layer: int, kv: PagedKVCache):
        self.config = config
        self.layers = layers
        self.first_layer = first_layer
        self.kv = kv
        self._windowed = [config.layer_uses_window(first_layer + i) for i in range(len(layers))]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        plan: AttentionPlan,
        layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """x: [T, H] -> [T, H] after every layer; cos, sin: [T, D]; slots: [T], where each token's K, V go.
        `layer_done(first_layer + i)` after layer i (`hetnode.node.engine.base.LayerDone`)."""
        cfg = self.config
        t = x.shape[0]
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_size, kv_size = cfg.q_size, cfg.kv_size
        cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, D]: one rotation for every head of a token
        eps = cfg.rms_norm_eps
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.input_norm, eps)
            qkv = w.qkv(h)  # [T, Q + 2 * KV]
            # Rotate q and k together: they are adjacent in the fused projection, one rotation covers both.
            qk = apply_rope(qkv[:, : q_size + kv_size].view(t, heads + kv_heads, d), cos, sin)
            q, k = qk[:, :heads], qk[:, heads:]  # [T, NH, D], [T, KVH, D]
            v = qkv[:, q_size + kv_size :].view(t, kv_heads, d)
            self.kv.write(i, slots, k, v)
            attn = paged_attention(q, k, v, self.kv.keys[i], self.kv.values[i], plan, self._windowed[i])
            x = x + w.o(attn)
            h = rms_norm(x, w.post_norm, eps)
            gate, up = w.gate_up(h).chunk(2, dim=-1)  # 2 x [T, I]
            x = x + w.down(F.silu(gate) * up)
            if layer_done is not None:
                layer_done(self.first_layer + i)
        return x
