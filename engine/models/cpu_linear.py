"""Linear layers for the CPU path: weights laid out once, after loading, for the GEMM that reads
them fastest.

`PackedLinear` (fp32, the default on CPU): oneDNN with its weight prepacked into oneDNN's
blocked layout. torch's own fp32 `mm` goes to MKL, which on this machine's AMD EPYC reaches
51-63 GFLOP/s at 32-512 rows against oneDNN's 86-105 (one thread, the bench model's shapes, all
layers' weights in turn so they stream from memory as in a real step). oneDNN's 1-3 row case is a
GEMV slower than its 4-row GEMM, so fewer rows are padded to 4: a decode step at batch 1 reads
the weights at ~19 GB/s instead of ~13.

`TransposedLinear` (fallback: other dtypes, or a torch built without oneDNN): the weight stored
[in, out], `x @ W_t`; MKL's GEMV on the usual [out, in] layout reads weights at ~11 GB/s.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

MIN_ROWS = 4  # oneDNN: a 4-row GEMM beats the 1-3 row GEMV on the same weights
PACK_ROWS_HINT = 32  # rows oneDNN blocks the weight for (hints 4, 32, 512 measured alike; 1 is 2x slower at 8 rows)


@functools.lru_cache(maxsize=None)
def onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's prepacked linear (a CPU build with mkldnn)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 4), PACK_ROWS_HINT)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), w, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(y, torch.full((2, 8), 4.0)))


class PackedLinear(nn.Module):
    """y = x W^T (+ b) on oneDNN with W [out, in] prepacked (an opaque oneDNN tensor)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach()  # [out, in]
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.weight_packed = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT),
                                          requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]  # x [T, in]
        if rows < MIN_ROWS:
            x = F.pad(x, (0, 0, 0, MIN_ROWS - rows))  # [4, in]
        y = torch.ops.mkldnn._linear_pointwise(x, self.weight_packed, self.bias, "none", [], "")  # [T', out]
        return y[:rows] if rows < MIN_ROWS else y


class TransposedLinear(nn.Module):
    """y = x @ weight_t (+ bias) with the weight stored [in, out]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)  # [in, out]
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight_t  # [T, out]
        return torch.addmm(self.bias, x, self.weight_t)  # [T, out]


def cpu_linear_kind(dtype: torch.dtype) -> str:
    """`packed` (oneDNN) for fp32 when this torch has it, else `transposed`."""
    return "packed" if dtype == torch.float32 and onednn_linear_available() else "transposed"


def relayout_linears(model: nn.Module, kind: str) -> None:
    """Swap every nn.Linear in `model` for a `kind` ('packed' or 'transposed') layer holding the
    same weights; the dense originals are dropped (a tied LM head gets its own copy)."""
    make = {"packed": PackedLinear, "transposed": TransposedLinear}[kind]
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, make(child))
        else:
            relayout_linears(child, kind)
