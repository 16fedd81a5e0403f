"""The width of a KV pool's rows by its dtype name, for every layer that maps or checks a pool
(torch-free: the layout travels in messages). An int8 pool (--kv-cache-dtype int8,
kernels/kv_int8.py) stores each head's row as its `head_dim` int8 values followed by their fp32
scale; any other dtype stores `head_dim` values."""

from __future__ import annotations

INT8_SCALE_BYTES = 4  # one fp32 after the values of an int8 row


def row_width(head_dim: int, dtype: str) -> int:
    """Elements of a pool row (its last axis) for `head_dim` values stored as `dtype` ("int8", "float32", ...)."""
    if dtype != "int8":
        return head_dim
    if head_dim % 4:
        raise ValueError(f"--kv-cache-dtype int8 needs head_dim a multiple of 4, got {head_dim}")
    return head_dim + INT8_SCALE_BYTES
