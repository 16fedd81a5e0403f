"""copy_blocks (used by the shm sender and the receiver) equals plain indexing for every id pattern."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.kvtransfer.sender import copy_blocks


@pytest.mark.parametrize("seed", range(4))
def test_copy_blocks_matches_indexing(seed):
    rng = random.Random(seed)
    for _ in range(100):
        n_src, n_dst = rng.randint(1, 40), rng.randint(1, 40)
        n = rng.randint(1, min(n_src, n_dst))
        src_ids, dst_ids = rng.sample(range(n_src), n), rng.sample(range(n_dst), n)
        if rng.random() < 0.4:  # consecutive source (fresh prefill pool)
            a = rng.randint(0, n_src - n)
            src_ids = list(range(a, a + n))
        if rng.random() < 0.4:  # consecutive destination (fresh decode pool)
            a = rng.randint(0, n_dst - n)
            dst_ids = list(range(a, a + n))
        src = torch.randn(2, n_src, 2, 3, 4)
        if rng.random() < 0.2:  # a received payload: the whole source, in order
            src, src_ids = torch.randn(2, n, 2, 3, 4), list(range(n))
        dst = torch.full((2, n_dst, 2, 3, 4), -1.0)
        want = dst.clone()
        want[:, dst_ids] = src[:, src_ids]
        copy_blocks(dst, dst_ids, src, src_ids)
        assert torch.equal(dst, want), (src_ids, dst_ids)
