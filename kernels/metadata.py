"""Attention metadata for one ragged batch (see docs/ARCHITECTURE.md for the picture)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    cu_seqlens_q: torch.Tensor  # [B+1] int32: query token offsets per sequence
    context_lens: torch.Tensor  # [B] int32: KV length per sequence INCLUDING this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    num_decode_seqs: int  # the first num_decode_seqs sequences have exactly one query token
    max_q_len: int
    max_context_len: int
    cu_seqlens_q_cpu: list[int]  # python copies: loop bounds without device syncs
    context_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_cpu)
