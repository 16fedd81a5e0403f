"""This machine's ceilings, measured in the same run as any figure compared against them."""

from __future__ import annotations

import time

import torch


def best_of(fn, repeat: int) -> float:
    """The fastest of `repeat` timed calls of `fn`, after one untimed call (seconds)."""
    fn()  # warm up
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_memcpy_gbps(nbytes: int = 256 * 2**20, repeat: int = 5) -> float:
    """Bytes copied per second (GB/s, 1e9) by a plain tensor copy of `nbytes`."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    return nbytes / best_of(lambda: dst.copy_(src), repeat) / 1e9


def measure_read_gbps(nbytes: int = 256 * 2**20, repeat: int = 5) -> float:
    """Bytes read per second (GB/s, 1e9) by a sum over `nbytes`: the ceiling of a step that only
    reads (decode streams weights and KV). A copy moves each byte twice, so memcpy's figure
    counts half the traffic a read-only stream can have."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / best_of(lambda: src.sum(), repeat) / 1e9


def measure_matmul_gflops(n: int = 2048, dtype: torch.dtype = torch.float32, repeat: int = 5) -> float:
    """Dense square matmul FLOP/s (GFLOP/s) at the dtype the model runs in: the faster of torch's
    `mm` (MKL for fp32) and oneDNN with a prepacked weight (what the engine's CPU linears use;
    on AMD CPUs MKL falls well short of it), so MFU is taken against the best this machine does."""
    from pdserve.engine.models.cpu_linear import PackedLinear, cpu_linear_kind

    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    best = best_of(lambda: a @ b, repeat)
    if cpu_linear_kind(dtype) == "packed":
        dense = torch.nn.Linear(n, n, bias=False, dtype=dtype)
        packed = PackedLinear(dense, gemv_copy=False)  # the engine's own CPU linear
        with torch.inference_mode():
            best = min(best, best_of(lambda: packed(a), repeat))
    return 2 * n**3 / best / 1e9
