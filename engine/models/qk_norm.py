"""Qwen3's q/k norm: an RMSNorm over each head of q and of k, after the projection, before RoPE."""

from __future__ import annotations

import torch

from pdserve.kernels import layer_ops


def norm_qk_heads(
    qkv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    eps: float,
) -> torch.Tensor:
    """qkv [T, (Hq + 2 Hkv) D] -> the same rows with each q and k head normalised (v untouched)."""
    T = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = layer_ops.rms_norm(q.reshape(T * num_heads, head_dim), q_weight, eps)  # [T Hq, D]
    k = layer_ops.rms_norm(k.reshape(T * num_kv_heads, head_dim), k_weight, eps)  # [T Hkv, D]
    return torch.cat((q.view(T, -1), k.view(T, -1), v), dim=-1)  # [T, (Hq + 2 Hkv) D]
