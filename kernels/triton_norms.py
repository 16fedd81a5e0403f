"""RMSNorm, optionally fused with the residual add before it, in one Triton kernel: the GPU twin of
kernels/cpu_layer_ops.c's. Torch's formula (kernels/layer_ops.py `rms_norm_torch`, HF's) is eight
kernels a norm; a decode step replayed from a CUDA graph pays each launch, about 2-3 µs, so a
Llama-3-8B step's 64 norms cost a millisecond in launches alone (docs/benchmarks/gpu.md).

One program per row (the row fits one tile: hidden sizes up to 16k), fp32 sums, and the same
roundings as the torch formula: `x + delta` rounded to the activations' dtype before it is
normed, `x * rsqrt(mean(x^2) + eps)` rounded to that dtype, then multiplied by the weight in the
promoted dtype. Only the sum's order differs from torch's reduction.

Imports triton; kernels/layer_ops.py dispatches here for CUDA tensors when triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    delta_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    sx,
    sd,
    so,
    ss,
    n,
    eps,
    HAS_DELTA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Row r: (with HAS_DELTA) s = x + delta, stored; out = w * norm(s) (else norm(x))."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * sx + offs, mask=mask, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * sd + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # rounded as torch's x + delta
        tl.store(sum_ptr + row * ss + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    mean_sq = tl.sum(x32 * x32, axis=0) / n
    y = (x32 * tl.math.rsqrt(mean_sq + eps)).to(x_ptr.dtype.element_ty)  # [BLOCK] in the activations' dtype
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = w.to(tl.float32) * y.to(tl.float32)
    tl.store(out_ptr + row * so + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Rows [T, N] with a dense last dim and a dense weight [N] on one device."""
    return x.dim() == 2 and x.stride(1) == 1 and weight.dim() == 1 and weight.is_contiguous() and x.shape[1] <= 16384


def _launch(x, delta, weight, out, total, eps: float) -> None:
    rows, n = x.shape
    if rows == 0:
        return
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x,
        delta if delta is not None else x,
        weight,
        out,
        total if total is not None else out,
        x.stride(0),
        delta.stride(0) if delta is not None else 0,
        out.stride(0),
        total.stride(0) if total is not None else 0,
        n,
        eps,
        HAS_DELTA=delta is not None,
        BLOCK=block,
        num_warps=8 if block >= 4096 else 4,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] -> weight * norm(x) [T, N], in the promoted dtype of x and weight (as torch's)."""
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch(x, None, weight, out, None, eps)
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, weight * norm(x + delta)), both [T, N]; x and delta of one dtype."""
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _launch(x, delta, weight, out, total, eps)
    return total, out
