"""Copy KV blocks between pools without intermediate tensors.

Block ids usually come in runs (a free list hands out consecutive blocks), so a request's
blocks are copied as a few slices rather than gathered into a fresh buffer first: fresh large
buffers cost page faults that dwarf the copy itself.

    src ids [7 8 9 | 2 3]   dst ids [40 41 42 | 43 44]  ->  runs (7,40,3) and (2,43,2)
"""
from __future__ import annotations

import torch


def block_runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both sides are consecutive."""
    assert len(src_ids) == len(dst_ids)
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_ids, dst_ids):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs


def copy_blocks(dst_layer: torch.Tensor, dst_ids: list[int], src_layer: torch.Tensor,
                src_ids: list[int]) -> None:
    """dst_layer[:, dst_ids] = src_layer[:, src_ids]; layers are [2, N, bs, Hkv, D]."""
    for s, d, n in block_runs(src_ids, dst_ids):
        dst_layer[:, d:d + n].copy_(src_layer[:, s:s + n])

