"""Linear layers for the CPU path: weights laid out once, after loading, for the GEMM that reads
them fastest.

`PackedLinear` (fp32, the default on CPU): oneDNN with its weight prepacked into oneDNN's
blocked layout. torch's own fp32 `mm` goes to MKL, which on this machine's AMD EPYC reaches
51-63 GFLOP/s at 32-512 rows against oneDNN's 86-105 (one thread, the bench model's shapes, all
layers' weights in turn so they stream from memory as in a real step). oneDNN's 2-3 row case is
slower than its 4-row GEMM, so such inputs are padded to 4 rows. Up to `panel_gemm.few_rows()` rows (decode
steps at small batch) a second copy of the weight in panels of 16 columns serves them: the C
few-row GEMM of kernels/cpu_panel_gemm.c, each thread streaming whole panels, ran all the bench
model's linears at one row in 4.2 ms against 7.5-7.9 for the C GEMV on an `[in, out]` copy and
6.7-9.1 for oneDNN. Since its next panel is prefetched into L2 rather than L1 it also beats
oneDNN from 5 to 12 rows (by 25-40%, all the bench model's linears A/B in one process); its
6-row AVX2 tile drew level at 16-32, the 16-row AVX-512 one beats oneDNN up to 32 rows
(docs/benchmarks/engine.md). The copy is kept unless the linear weights are over 1/8
of the machine's memory (then small inputs pad to 4 and read the packed weight). Without the C
kernel, one-row inputs use an `[in, out]` copy (GEMV).

`TransposedLinear` (fallback: other dtypes, or a torch built without oneDNN): the weight stored
[in, out], `x @ W_t` (MKL's GEMV is slower on the usual [out, in] layout; docs/benchmarks/engine.md).
For bf16 weights it also keeps the panel copy, when it fits as for fp32: decode steps of up to
`few_rows()` rows read bf16 panels widened to fp32 in the tile (torch's bf16 GEMV on this CPU ran
at a fraction of the memory rate; docs/benchmarks/engine.md).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.config import machine_memory_bytes
from pdserve.env import settings
from pdserve.kernels import cpu_native, panel_gemm

MIN_ROWS = 4  # oneDNN: a 4-row GEMM beats the 1-3 row GEMV on the same weights
# oneDNN (primitive cache) and torch's ideep layer (LRU_CACHE_CAPACITY) each keep ~0.6 MB per
# (rows, weight shape) seen, 1024 of them by default: prefill steps of every length grew a worker
# by ~2.5 MB per new length, up to GBs. 64 entries keep decode's few shapes hot and cost a new
# prefill length ~2 ms per weight shape (~3% of a 512-token step).
ONEDNN_CACHE_ENTRIES = "64"
PACK_ROWS_HINT = 32  # rows oneDNN blocks the weight for (hints 4, 32, 512 measured alike; 1 is 2x slower at 8 rows)


@functools.lru_cache(maxsize=None)
def onednn_linear_available() -> bool:
    """Whether this torch has oneDNN's prepacked linear (a CPU build with mkldnn). Bounds its
    shape caches first: both read their capacity from the environment at first use."""
    if not torch.backends.mkldnn.is_available():
        return False
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)
    os.environ.setdefault("LRU_CACHE_CAPACITY", ONEDNN_CACHE_ENTRIES)
    try:
        w = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 4), PACK_ROWS_HINT)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4), w, None, "none", [], "")
    except (AttributeError, RuntimeError):
        return False
    return bool(torch.allclose(y, torch.full((2, 8), 4.0)))


class PackedLinear(nn.Module):
    """y = x W^T (+ b) on oneDNN with W [out, in] prepacked (an opaque oneDNN tensor). With
    `gemv_copy`, a second copy serves few-row inputs: panels for the C few-row GEMM (up to
    `panel_gemm.few_rows()` rows) when it built, else an [in, out] copy for one-row inputs."""

    def __init__(self, linear: nn.Linear, gemv_copy: bool = True) -> None:
        super().__init__()
        w = linear.weight.detach()  # [out, in]
        self.in_features, self.out_features = w.shape[1], w.shape[0]
        self.weight_packed = nn.Parameter(
            torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT), requires_grad=False
        )
        self.bias = linear.bias
        self.panels = self.gemv = None
        if gemv_copy and few_row_kernel_enabled(w.dtype) and (self.bias is None or self.bias.is_contiguous()):
            self.panels = nn.Parameter(panel_gemm.pack(w), requires_grad=False)  # [ceil(out/16), in, 16]
        elif gemv_copy:
            self.gemv = TransposedLinear(linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]  # x [T, in]
        if self.panels is not None and rows <= panel_gemm.few_rows() and x.stride(-1) == 1:
            return panel_gemm.linear(x, self.panels, self.bias, self.out_features)  # [T, out]
        if rows == 1 and self.gemv is not None:
            return self.gemv(x)  # [1, out]
        if rows < MIN_ROWS:
            x = F.pad(x, (0, 0, 0, MIN_ROWS - rows))  # [4, in]
        y = torch.ops.mkldnn._linear_pointwise(x, self.weight_packed, self.bias, "none", [], "")  # [T', out]
        return y[:rows] if rows < MIN_ROWS else y


class TransposedLinear(nn.Module):
    """y = x @ weight_t (+ bias) with the weight stored [in, out]. One fp32 row goes to the C GEMV
    (kernels/cpu_gemv.c: MKL's does not go faster with a second thread here, it does) when it
    built and PDSERVE_CPU_GEMV is not `torch`, and so does one bf16 row (`gemv_bf16`: torch's
    bf16 matmul ran it at a fraction of the memory rate). With `panels` (bf16 weights), inputs of
    up to `few_rows()` rows go to the C few-row GEMM on a panel copy instead."""

    def __init__(self, linear: nn.Linear, panels: bool = False) -> None:
        super().__init__()
        w = linear.weight.detach()  # [out, in]
        self.weight_t = nn.Parameter(w.t().contiguous(), requires_grad=False)  # [in, out]
        self.bias = linear.bias
        self.out_features = w.shape[0]
        self.panels = None
        if panels and w.dtype == torch.bfloat16 and few_row_kernel_enabled(w.dtype):
            if self.bias is None or (self.bias.dtype == w.dtype and self.bias.is_contiguous()):
                self.panels = nn.Parameter(panel_gemm.pack(w), requires_grad=False)  # [ceil(out/16), in, 16]
        self.native_gemv = (
            self.weight_t.dtype in (torch.float32, torch.bfloat16)
            and self.weight_t.device.type == "cpu"
            and settings().cpu_gemv != "torch"
            and cpu_native.gemv_available()
            and (self.bias is None or (self.bias.is_contiguous() and self.bias.dtype == self.weight_t.dtype))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (
            self.panels is not None
            and x.dim() == 2
            and x.shape[0] <= panel_gemm.few_rows()
            and x.dtype == self.panels.dtype
            and x.stride(-1) == 1
        ):
            return panel_gemm.linear(x, self.panels, self.bias, self.out_features)  # [T, out]
        if self.native_gemv and x.shape[0] == 1 and x.dtype == self.weight_t.dtype and x.is_contiguous():
            return cpu_native.gemv(x, self.weight_t, self.bias)  # [1, out]
        if self.bias is None:
            return x @ self.weight_t  # [T, out]
        return torch.addmm(self.bias, x, self.weight_t)  # [T, out]


def few_row_kernel_enabled(dtype: torch.dtype) -> bool:
    """The C few-row GEMM for fp32 or bf16 weights, when it built and PDSERVE_CPU_GEMV is not `torch`."""
    return dtype in (torch.float32, torch.bfloat16) and settings().cpu_gemv != "torch" and panel_gemm.available()


def cpu_linear_kind(dtype: torch.dtype) -> str:
    """`packed` (oneDNN) for fp32 when this torch has it, else `transposed`."""
    return "packed" if dtype == torch.float32 and onednn_linear_available() else "transposed"


def gemv_copy_fits(model: nn.Module) -> bool:
    """Whether an extra [in, out] copy of every linear weight stays under 1/8 of the machine's
    memory (engine/config.py `machine_memory_bytes`: MemTotal or a lower cgroup limit)."""
    linear_bytes = sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))
    ram = machine_memory_bytes()
    return ram is not None and linear_bytes * 8 <= ram


def relayout_linears(model: nn.Module, kind: str, gemv_copy: bool = True) -> None:
    """Swap every nn.Linear in `model` for a `kind` ('packed' or 'transposed') layer holding the
    same weights; the dense originals are dropped (a tied LM head gets its own copy)."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(
                model, name, PackedLinear(child, gemv_copy) if kind == "packed" else TransposedLinear(child, gemv_copy)
            )
        else:
            relayout_linears(child, kind, gemv_copy)
