"""Quantized KV rows (`--kv-cache-dtype int8|fp8`): one token's K (or V) for one KV head, stored
as its `head_dim` one-byte values followed by their fp32 scale, in a pool whose last axis is
`head_dim + 4` bytes:

    pool [L, 2, N, bs, Hkv, D + 4]            one row (token t, head h):
                                              | q[0] q[1] ... q[D-1] | scale (fp32, 4 bytes) |
    x[c] ~= value(q[c]) * scale,  scale = max|x| / QMAX,  q = encode(x / scale)

Two formats, told apart by the pool's dtype:

    --kv-cache-dtype  pool dtype  q[c]                                 QMAX  encode
    int8              int8        a signed integer                     127   round half to even
    fp8               uint8       float8 e4m3 (fn) bits: 4 exponent,   448   round to nearest even,
                                  3 mantissa, subnormals, no inf             saturating at +-448
                                                                             (never NaN)

fp8's pool is uint8, not torch's float8_e4m3fn: every index, copy and shared-memory op works on
it, and its dtype alone tells it from an int8 pool (`.view(torch.float8_e4m3fn)` gives the values).

A scale per token row and head (llama.cpp's q8_0 in spirit, one block of D values): a decode step
appends one token, so its row is quantized once, exactly, and no block is ever re-quantized. The
scale travels in the row, so everything that moves blocks (KV transfer, shared-memory writes,
copy-on-write, head re-slicing under tensor parallelism) moves scales with the values unchanged.
D must be a multiple of 4 (the scale stays 4-byte aligned). The C kernels read and write the same
bytes (kernels/kv_quant.h, cpu_layer_ops.c).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.protocol import kv_rows

SCALE_BYTES = kv_rows.SCALE_BYTES  # one fp32 after the D values of a row


def _encode_int8(y: torch.Tensor) -> torch.Tensor:
    return torch.round(y).clamp_(-127, 127).to(torch.int8)


def _encode_fp8(y: torch.Tensor) -> torch.Tensor:
    return y.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def _value_fp8(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.float8_e4m3fn).float()


@dataclass(frozen=True)
class RowFormat:
    """How one quantized row stores its values (the table above)."""

    kv_cache_dtype: str  # the --kv-cache-dtype that selects it
    pool_dtype: torch.dtype
    qmax: float  # the largest magnitude a value takes: scale = max|x| / qmax
    encode: Callable[[torch.Tensor], torch.Tensor]  # x / scale, fp32 -> the stored bytes (pool dtype)
    value: Callable[[torch.Tensor], torch.Tensor]  # stored bytes -> their values, fp32 (unscaled)


INT8 = RowFormat("int8", torch.int8, 127.0, _encode_int8, lambda q: q.float())
FP8 = RowFormat("fp8", torch.uint8, 448.0, _encode_fp8, _value_fp8)
FORMATS = {f.pool_dtype: f for f in (INT8, FP8)}


def format_of(pool: torch.Tensor | torch.dtype) -> RowFormat | None:
    """The row format of a pool (or a pool dtype); None for a pool of plain values."""
    return FORMATS.get(pool if isinstance(pool, torch.dtype) else pool.dtype)


def is_quantized(pool: torch.Tensor) -> bool:
    return pool.dtype in FORMATS


def pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """What a pool of --kv-cache-dtype `kv_cache_dtype` stores ("auto": the model's dtype)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    for f in FORMATS.values():
        if f.kv_cache_dtype == kv_cache_dtype:
            return f.pool_dtype
    raise ValueError(f"unknown --kv-cache-dtype {kv_cache_dtype!r}")


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of a pool row (its last axis) for `head_dim` values stored as `dtype`."""
    return kv_rows.row_width(head_dim, str(dtype).removeprefix("torch."))


def head_dim(pool: torch.Tensor) -> int:
    """The head_dim a pool (or a slice of it, last axis whole) holds."""
    return pool.shape[-1] - SCALE_BYTES if is_quantized(pool) else pool.shape[-1]


def quantize(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """x [..., D] float -> rows [..., D + 4] of `fmt`'s pool dtype: values, then the fp32 scale's bytes."""
    d = x.shape[-1]
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = amax / fmt.qmax  # [..., 1]
    inv = torch.where(amax > 0, fmt.qmax / amax, torch.zeros_like(amax))  # [..., 1]
    out = torch.empty((*x.shape[:-1], d + SCALE_BYTES), dtype=fmt.pool_dtype, device=x.device)  # [..., D + 4]
    out[..., :d] = fmt.encode(xf * inv)
    out[..., d:] = scale.view(fmt.pool_dtype)  # fp32 bytes, native order
    return out


def scales(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., D + 4] -> their scales [...] fp32 (a copy)."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """rows [..., D + 4] of a quantized pool -> [..., D] `dtype` (values times their row's scale, in fp32)."""
    fmt = format_of(rows)
    assert fmt is not None, f"not a quantized KV row: {rows.dtype}"
    d = rows.shape[-1] - SCALE_BYTES
    return (fmt.value(rows[..., :d]) * scales(rows)[..., None]).to(dtype)  # [..., D]


def roundtrip(x: torch.Tensor, fmt: RowFormat) -> torch.Tensor:
    """x [..., D] as a pool of `fmt` gives it back (same dtype): what attention reads."""
    return dequantize(quantize(x, fmt), x.dtype)
