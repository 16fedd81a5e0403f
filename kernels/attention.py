"""Dispatch: Triton kernels for CUDA tensors, pure torch otherwise.

`PDSERVE_ATTENTION=torch|triton` overrides (triton on CPU tensors needs TRITON_INTERPRET=1).
"""
from __future__ import annotations

import functools
import os

import torch

from kernels import torch_attention
from kernels.metadata import AttentionMetadata


@functools.lru_cache(maxsize=None)
def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _use_triton(t: torch.Tensor) -> bool:
    choice = os.environ.get("PDSERVE_ATTENTION", "")
    if choice == "torch":
        return False
    if choice == "triton":
        return True
    return t.is_cuda and _triton_available()


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    if _use_triton(key):
        from kernels import triton_attention
        return triton_attention.store_kv(key, value, kv_layer, slot_mapping)
    return torch_attention.store_kv(key, value, kv_layer, slot_mapping)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    if _use_triton(query):
        from kernels import triton_attention
        return triton_attention.paged_attention(query, key, value, kv_layer, meta, scale)
    return torch_attention.paged_attention(query, key, value, kv_layer, meta, scale)
