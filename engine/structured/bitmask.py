"""Token bitmasks (bit t of row b set = token t allowed) applied to logits."""

from __future__ import annotations

import torch

_BITS = torch.arange(32, dtype=torch.int32)  # [32]


def allocate_bitmask(rows: int, vocab: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32, every token allowed."""
    return torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """logits [B, V] in place: disallowed tokens -> -inf. mask [B, ceil(V / 32)] int32."""
    vocab = logits.shape[1]
    bits = (mask.unsqueeze(-1) >> _BITS) & 1  # [B, W, 32]
    allowed = bits.flatten(1)[:, :vocab].bool()  # [B, V]
    logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
