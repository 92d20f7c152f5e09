"""Linear layers whose weights are prepacked once for the CPU's fastest matmul kernel.

On CPU, `F.linear` calls MKL's sgemm. On AMD processors MKL takes a generic code path that runs three to
four times slower than oneDNN's kernels for the small-M shapes of decoding (measured on an EPYC: gate|up
projection of SmolLM2 at 8 tokens 390 us vs 95 us; the 49152-row LM head at 1 token 7.6 ms vs 2.7 ms).
oneDNN is what PyTorch's own compiler uses for CPU linears: the weight is reordered once into oneDNN's
blocked layout (`_reorder_linear_weight`) and every call goes to `_linear_pointwise`. Results equal
`F.linear` up to float32 rounding (a different summation order).

CUDA, and any build without oneDNN, uses `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


@functools.cache
def _onednn_works(dtype: torch.dtype) -> bool:
    """Whether the prepacked path exists in this build and agrees with F.linear for `dtype`."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    try:
        w = torch.randn(24, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
        x = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
        out = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(out.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2))


class Linear:
    """y = x @ weight^T + bias, for x: [T, in] -> [T, out]."""

    __slots__ = ("bias", "in_features", "nbytes", "out_features", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True) -> None:
        # weight: [out, in]; bias: [out]
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.nbytes = weight.nbytes + (bias.nbytes if bias is not None else 0)
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = weight
        if pack and weight.device.type == "cpu" and _onednn_works(weight.dtype):
            # The batch-size hint barely matters (measured 1 to 300 tokens); 8 suits batched decoding.
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
            self.weight = None  # the packed copy replaces it; keeping both would double the memory

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return out
        return F.linear(x, self.weight, self.bias)  # type: ignore[arg-type]
