"""Rotary position embedding (HF's rotate-half convention), with default/linear/llama3/longrope
scaling, over all of head_dim or (partial rotary) its first `rotary_dim` dims."""

from __future__ import annotations

import math

import torch
from torch import nn

from pdserve.engine.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, rotary_dim: int) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim  # [R/2]
    if rope.kind == "longrope":  # short factors: the engine stays within original_max_position
        return 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * rope.theta**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)  # [R/2]
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (ragged batches carry positions)."""

    def __init__(self, rope: RopeConfig, rotary_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rope, self.rotary_dim, self.max_positions = rope, rotary_dim, max_positions
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.build_tables()

    def build_tables(self, device: torch.device | None = None) -> None:
        """(Re)compute the fp32 tables, e.g. after the model was built on the meta device."""
        inv_freq = inverse_frequencies(self.rope, self.rotary_dim).to(device)  # [R/2]
        pos = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = pos[:, None] * inv_freq[None, :]  # [P, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, R]
        self.cos, self.sin = emb.cos(), emb.sin()
        if self.rope.attention_factor != 1.0:  # longrope scales both, as HF does
            self.cos, self.sin = self.cos * self.rope.attention_factor, self.sin * self.rope.attention_factor

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, R] for positions [T]: gathered once per step, shared by every layer."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any heads: q and k together) rotated by its tokens' cos, sin [T, 1, R]: all of
    D when R == D, else (partial rotary) its first R dims, the other D - R passing through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :r], x[..., r:]  # [T, H, R], [T, H, D - R]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
