"""A decoder layer's elementwise ops: RMSNorm (optionally fused with the residual add before it),
the MLP's silu(gate) * up, and rotary embedding fused with the KV store. fp32 CPU tensors go to
kernels/cpu_layer_ops.c (one pass over the rows; torch needs six to eight ops, each a sweep over
memory); CUDA tensors' norms to kernels/triton_norms.py (one kernel instead of eight launches);
everything else, and `PDSERVE_LAYER_OPS=torch`, takes the torch formulas (HF's), which are the
reference.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.env import settings
from pdserve.kernels.cpu_native import built, load_kernel

SOURCE = Path(__file__).with_name("cpu_layer_ops.c")
# the fused rotary + KV store by the pool's dtype: fp32, int8 rows, fp8 (e4m3) rows (kernels/kv_quant.py)
_ROPE_STORE = {torch.float32: "rope_store_f32", torch.int8: "rope_store_q8", torch.uint8: "rope_store_f8"}


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = load_kernel(SOURCE)
    if lib is None:
        return None
    i64, f32, p, i32 = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
    for name, args in (
        ("rmsnorm_f32", [p, i64, p, p, i64, i64, f32, i32]),
        ("add_rmsnorm_f32", [p, p, i64, p, p, p, i64, i64, f32, i32]),
        ("silu_mul_f32", [p, i64, p, i64, i64, i32]),
        ("rope_store_f32", [p, i64, p, p, p, p, p, i64, p, i64, i32, i32, i32, i32]),
        ("rope_store_q8", [p, i64, p, p, p, p, p, i64, p, i64, i32, i32, i32, i32]),
        ("rope_store_f8", [p, i64, p, p, p, p, p, i64, p, i64, i32, i32, i32, i32]),
        ("f8_from_f32_n", [p, p, i64]),
    ):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, args
    return lib


def native_available() -> bool:
    """Whether the C ops are built and loaded (tried once per process)."""
    return _library() is not None


def _native(*tensors: torch.Tensor) -> bool:
    """fp32 CPU tensors whose last dim is dense, with the C ops built and not switched off."""
    return (
        all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1 for t in tensors)
        and settings().layer_ops != "torch"
        and native_available()
    )


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: in fp32, then back to x's dtype, times the weight."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _gpu_norm(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None = None) -> bool:
    """CUDA rows the Triton norm takes (kernels/triton_norms.py), with triton installed and the
    ops not switched off (`PDSERVE_LAYER_OPS=torch`)."""
    if not (x.is_cuda and settings().layer_ops != "torch"):
        return False
    from pdserve.kernels.attention import triton_available

    if not triton_available():
        return False
    from pdserve.kernels import triton_norms

    if delta is not None and not (delta.shape == x.shape and delta.dtype == x.dtype and delta.stride(-1) == 1):
        return False
    return triton_norms.takes(x, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] -> [T, H]."""
    if _gpu_norm(x, weight):
        from pdserve.kernels import triton_norms

        return triton_norms.rms_norm(x, weight, eps)
    if not (_native(x) and weight.dtype == torch.float32 and weight.is_contiguous()):
        return rms_norm_torch(x, weight, eps)
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=torch.float32)
    built(_library()).rmsnorm_f32(
        x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), rows, n, eps, torch.get_num_threads()
    )
    return out


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: x, delta [T, H] -> (x + delta, rms_norm(x + delta))."""
    if _gpu_norm(x, weight, delta):
        from pdserve.kernels import triton_norms

        return triton_norms.add_rms_norm(x, delta, weight, eps)
    if not (_native(x, delta) and x.is_contiguous() and weight.dtype == torch.float32 and weight.is_contiguous()):
        total = x + delta
        return total, rms_norm_torch(total, weight, eps)
    rows, n = x.shape
    total = torch.empty(rows, n, dtype=torch.float32)
    out = torch.empty(rows, n, dtype=torch.float32)
    built(_library()).add_rmsnorm_f32(
        x.data_ptr(),
        delta.data_ptr(),
        delta.stride(0),
        weight.data_ptr(),
        total.data_ptr(),
        out.data_ptr(),
        rows,
        n,
        eps,
        torch.get_num_threads(),
    )
    return total, out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] (rows = [gate | up]) -> silu(gate) * up [T, I]."""
    n = gate_up.shape[-1] // 2
    if not _native(gate_up):
        gate, up = gate_up.split(n, dim=-1)
        return F.silu(gate) * up
    rows = gate_up.shape[0]
    out = torch.empty(rows, n, dtype=torch.float32)
    built(_library()).silu_mul_f32(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, n, torch.get_num_threads()
    )
    return out


def rope_store(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
):
    """The fused qkv projection's rows [T, (Hq + 2 Hkv) D]: q and k rotated by cos, sin [T, 1, D],
    k and v stored into kv_layer [2, N, bs, Hkv, D] at slot_mapping [T] (-1: not stored); a
    quantized pool [2, N, bs, Hkv, D + 4] (--kv-cache-dtype int8|fp8: dtype int8|uint8) takes the
    rows quantized, as kernels/kv_quant.py's quantize does, bit for bit.
    Returns q [T, Hq, D], k [T, Hkv, D] (rotated, dense) and v [T, Hkv, D] (a view of qkv), or
    None when these tensors are not for the C op (the caller then rotates and stores in torch)."""
    d = cos.shape[-1]
    if not (
        _native(qkv)
        and cos.dtype == torch.float32
        and cos.is_contiguous()
        and sin.is_contiguous()
        and kv_layer.device.type == "cpu"
        and kv_layer.dtype in _ROPE_STORE
        and kv_layer.is_contiguous()
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
    ):
        return None
    rows = qkv.shape[0]
    _, n, bs, hkv, _ = kv_layer.shape
    q = torch.empty(rows, num_heads, d, dtype=torch.float32)
    k = torch.empty(rows, num_kv_heads, d, dtype=torch.float32)
    lib = built(_library())
    rc = getattr(lib, _ROPE_STORE[kv_layer.dtype])(
        qkv.data_ptr(),
        qkv.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        q.data_ptr(),
        k.data_ptr(),
        kv_layer.data_ptr(),
        n * bs,
        slot_mapping.data_ptr(),
        rows,
        num_heads,
        num_kv_heads,
        d,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise IndexError(f"slot_mapping holds a slot past the KV pool ({n * bs} slots)")
    v = qkv[:, (num_heads + num_kv_heads) * d :].view(rows, num_kv_heads, d)
    return q, k, v


def f8_from_f32(x: torch.Tensor) -> torch.Tensor:
    """x fp32 (contiguous, CPU) -> its e4m3 bits [same shape] uint8, by the C KV store's conversion
    (kernels/kv_quant.h): torch's x.clamp(-448, 448).to(torch.float8_e4m3fn), bit for bit."""
    assert x.dtype == torch.float32 and x.is_contiguous() and x.device.type == "cpu"
    out = torch.empty(x.shape, dtype=torch.uint8)
    built(_library()).f8_from_f32_n(x.data_ptr(), out.data_ptr(), x.numel())
    return out
