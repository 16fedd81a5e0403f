"""The host KV pool is checked against the machine's available memory before it is zeroed: a
budget the machine cannot hold is refused at start with the numbers, not killed mid-start."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import kv_cache
from pdserve.engine.kv_cache import KVCacheSpec, allocate_kv_cache


def test_a_pool_larger_than_the_available_memory_is_refused_with_what_fits(monkeypatch):
    spec = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8, dtype=torch.float32)  # 4 KiB a block
    monkeypatch.setattr(kv_cache, "available_host_memory", lambda: kv_cache.HEADROOM_BYTES + 10 * 4096)
    with pytest.raises(MemoryError, match=r"about 10 blocks \(160 tokens\) fit. Lower --kv-cache-memory"):
        allocate_kv_cache(spec, 64, torch.device("cpu"))
    pool = allocate_kv_cache(spec, 10, torch.device("cpu"))  # what the message says fits
    assert pool.shape == (2, 2, 10, 16, 2, 8) and not pool.any()


def test_the_available_memory_is_read_from_the_kernel():
    free = kv_cache.available_host_memory()
    with open("/proc/meminfo") as f:
        total = int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) * 1024
    assert free is not None and 0 < free <= total
