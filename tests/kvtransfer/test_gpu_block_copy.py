"""The one-pass gather-scatter of KV blocks (kvtransfer/gpu_block_copy.py) against torch indexing,
under Triton's interpreter on the CPU (TRITON_INTERPRET=1 must be set before triton is first
imported, so the kernel runs in a subprocess: this file as a script). On a GPU the CUDA IPC
tests run it compiled (tests/gpu/test_cuda_ipc.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
REPO = Path(__file__).resolve().parents[2]
# (source blocks, destination blocks, block size, heads, head dim, dtype): one chunk per block's
# K or V (masked tail), and 8192 elements = two chunks
CASES = [(7, 9, 4, 2, 8, "float32"), (5, 12, 16, 8, 64, "bfloat16"), (3, 3, 16, 1, 16, "float16")]


def matches() -> list[bool]:
    import torch

    from pdserve.kvtransfer import gpu_block_copy

    gen = torch.Generator().manual_seed(0)
    out = []
    for n_src, n_dst, bs, h, d, dtype_name in CASES:
        dtype = getattr(torch, dtype_name)
        src = torch.randn(2, n_src, bs, h, d, generator=gen).to(dtype)
        dst = torch.zeros(2, n_dst, bs, h, d, dtype=dtype)
        k = min(n_src, n_dst)
        src_ids = torch.randperm(n_src, generator=gen)[:k]
        dst_ids = torch.randperm(n_dst, generator=gen)[:k]
        want = dst.clone()
        want[:, dst_ids] = src[:, src_ids]
        assert gpu_block_copy.takes(dst, src)
        gpu_block_copy.copy_blocks(dst, dst_ids.to(torch.int32), src, src_ids.to(torch.int32))
        out.append(bool(torch.equal(dst, want)))
    return out


def test_blocks_land_where_the_ids_say_bit_for_bit():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-m", "tests.kvtransfer.test_gpu_block_copy"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True] * len(CASES)


def test_it_takes_only_whole_contiguous_layers_of_one_shape():
    import torch

    from pdserve.kvtransfer.gpu_block_copy import takes

    a = torch.zeros(2, 4, 16, 2, 8)
    assert takes(a, torch.zeros(2, 9, 16, 2, 8))
    assert not takes(a, torch.zeros(2, 4, 16, 2, 8, dtype=torch.float16))
    assert not takes(a[:, :, :, :1], torch.zeros(2, 4, 16, 1, 8))  # a head slice: not contiguous
    assert not takes(a, torch.zeros(2, 4, 8, 2, 8))


if __name__ == "__main__":
    print(json.dumps(matches()))
