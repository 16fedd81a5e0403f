"""The int8 KV row (`--kv-cache-dtype int8`): one token's K (or V) for one KV head, stored as
its `head_dim` int8 values followed by their fp32 scale, in a pool of dtype int8 whose last axis
is `head_dim + 4` bytes:

    pool [L, 2, N, bs, Hkv, D + 4] int8       one row (token t, head h):
                                              | q[0] q[1] ... q[D-1] | scale (fp32, 4 bytes) |
    x[c] ~= q[c] * scale,  scale = max|x| / 127,  q = round-to-nearest-even(x / scale)

A scale per token row and head (llama.cpp's q8_0 in spirit, one block of D values): a decode step
appends one token, so its row is quantized once, exactly, and no block is ever re-quantized. The
scale travels in the row, so everything that moves blocks (KV transfer, shared-memory writes,
copy-on-write, head re-slicing under tensor parallelism) moves scales with the values unchanged.
D must be a multiple of 4 (the scale stays 4-byte aligned).
"""

from __future__ import annotations

import torch

from pdserve.protocol import kv_rows

SCALE_BYTES = kv_rows.INT8_SCALE_BYTES  # one fp32 after the D values of a row


def is_int8(pool: torch.Tensor) -> bool:
    return pool.dtype == torch.int8


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of a pool row (its last axis) for `head_dim` values stored as `dtype`."""
    return kv_rows.row_width(head_dim, str(dtype).removeprefix("torch."))


def head_dim(pool: torch.Tensor) -> int:
    """The head_dim a pool (or a slice of it, last axis whole) holds."""
    return pool.shape[-1] - SCALE_BYTES if is_int8(pool) else pool.shape[-1]


def quantize(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] float -> rows [..., D + 4] int8: values, then the fp32 scale's bytes."""
    d = x.shape[-1]
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = amax / 127.0  # [..., 1]
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))  # [..., 1]
    q = torch.round(xf * inv).clamp_(-127, 127).to(torch.int8)  # [..., D]
    out = torch.empty((*x.shape[:-1], d + SCALE_BYTES), dtype=torch.int8, device=x.device)  # [..., D + 4]
    out[..., :d] = q
    out[..., d:] = scale.view(torch.int8)  # fp32 bytes, native order
    return out


def scales(rows: torch.Tensor) -> torch.Tensor:
    """rows [..., D + 4] int8 -> their scales [...] fp32 (a copy)."""
    return rows[..., -SCALE_BYTES:].contiguous().view(torch.float32).squeeze(-1)


def dequantize(rows: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """rows [..., D + 4] int8 -> [..., D] `dtype` (values times their row's scale, in fp32)."""
    d = rows.shape[-1] - SCALE_BYTES
    return (rows[..., :d].float() * scales(rows)[..., None]).to(dtype)  # [..., D]


def roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] as the int8 pool gives it back (same dtype): what attention reads."""
    return dequantize(quantize(x), x.dtype)
