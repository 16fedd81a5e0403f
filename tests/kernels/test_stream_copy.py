"""kernels/stream_copy.py: the streaming-store copy equals torch's, whatever the size, alignment
or dtype, and KV block runs copied through it (kvtransfer/sender.py `copy_blocks`, as workers set
it up) land bit for bit, the blocks around them untouched."""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from pdserve.kernels import stream_copy
from pdserve.kvtransfer import sender


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None, reason="x86 with a C compiler"
)
def test_the_streaming_kernel_is_built_here():
    """Else every copy below falls back to torch's and the tests would not see the kernel."""
    assert stream_copy._library() is not None


@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 1000, stream_copy.STREAM_MIN_BYTES // 4 + 3, 1 << 20])
@pytest.mark.parametrize("offset", [0, 1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_equals_torch_copy_at_any_size_and_alignment(numel, offset, dtype):
    src = torch.randn(numel + offset).to(dtype)[offset:]
    out = torch.zeros(numel + 2 * offset + 2, dtype=dtype)
    dst = out[offset + 1 : offset + 1 + numel]
    stream_copy.copy_addr(dst.data_ptr(), src.data_ptr(), numel * src.element_size())
    assert torch.equal(out[offset + 1 : offset + 1 + numel], src)
    assert not out[: offset + 1].any() and not out[offset + 1 + numel :].any()  # nothing outside


def test_kv_block_runs_through_copy_blocks(monkeypatch):
    monkeypatch.setattr(sender, "_contiguous_copy", sender._memmove)
    sender.use_contiguous_copy(stream_copy.copy_addr)
    src = torch.randn(2, 300, 16, 4, 64)  # [2, N, bs, Hkv, D]: 256 KiB a block's K or V x 16 blocks
    dst = torch.zeros_like(src)
    src_ids, dst_ids = list(range(10, 110)), list(range(150, 250))  # one run of 100 blocks
    sender.copy_blocks(dst, dst_ids, src, src_ids)
    assert torch.equal(dst[:, 150:250], src[:, 10:110])
    assert not dst[:, :150].any() and not dst[:, 250:].any()
    heads = torch.zeros(2, 300, 16, 8, 64)[:, :, :, 2:6]  # a rank's head slice: not contiguous
    sender.copy_blocks(heads, dst_ids, src, src_ids)
    assert torch.equal(heads[:, 150:250], src[:, 10:110])
