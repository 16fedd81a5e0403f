"""Attention metadata for one ragged batch (see docs/ARCHITECTURE.md for the picture)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each sequence's queries and KV live. Decode sequences (q_len 1) come first.

    Query token `j` of sequence `b` sits at position `context_lens[b] - q_len[b] + j` and attends
    causally to KV positions `0 .. that position` (bottom-right aligned when context > q_len).
    """

    cu_seqlens_q: torch.Tensor  # [B+1] int32: query token offsets per sequence
    context_lens: torch.Tensor  # [B] int32: KV length per sequence INCLUDING this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    num_decode_seqs: int  # the first num_decode_seqs sequences have exactly one query token
    max_q_len: int
    max_context_len: int
    cu_seqlens_q_cpu: list[int]  # python copies: loop bounds without device syncs
    context_lens_cpu: list[int]
    # Per sequence: its first block id when its block table is one run of consecutive blocks
    # (its KV is one contiguous stretch of the pool, readable in place), else -1. None: unknown.
    kv_run_start_cpu: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens_cpu)

    @classmethod
    def build(
        cls,
        q_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        num_decode_seqs: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """From python lists (tests, tools); block tables are padded with 0 to the longest."""
        if len(q_lens) != len(context_lens) or len(q_lens) != len(block_tables):
            raise ValueError("q_lens, context_lens and block_tables need one entry per sequence")
        if any(q != 1 for q in q_lens[:num_decode_seqs]):
            raise ValueError("the first num_decode_seqs sequences must have q_len 1")
        if any(q < 1 or q > c for q, c in zip(q_lens, context_lens)):
            raise ValueError("need 1 <= q_len <= context_len for every sequence")
        cu = [0]
        for q in q_lens:
            cu.append(cu[-1] + q)
        width = max((len(t) for t in block_tables), default=0)
        tables = [list(t) + [0] * (width - len(t)) for t in block_tables]
        return cls(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            context_lens=torch.tensor(list(context_lens), dtype=torch.int32, device=device),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=device).view(len(tables), width),
            num_decode_seqs=num_decode_seqs,
            max_q_len=max(q_lens, default=0),
            max_context_len=max(context_lens, default=0),
            cu_seqlens_q_cpu=cu,
            context_lens_cpu=list(context_lens),
            kv_run_start_cpu=[run_start(t) for t in block_tables],
        )


def run_start(table: Sequence[int]) -> int:
    """First block of `table` when it is one run of consecutive block ids, else -1."""
    if not table:
        return -1
    first = table[0]
    if table[-1] - first != len(table) - 1:
        return -1
    return first if all(b == first + i for i, b in enumerate(table)) else -1
