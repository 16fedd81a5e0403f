"""Few-row linear layers (a decode step's batch) in C, kernels/cpu_panel_gemm.c, on weights packed
once into panels of 16 output columns. Callers check `available()`; CPU, fp32 or bf16 (bf16
weights widened to fp32 in the tile, summed in fp32, each output rounded once: half the bytes a
decode step reads).
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu_native import built, load_kernel

SOURCE = Path(__file__).with_name("cpu_panel_gemm.c")
PANEL = 16  # output columns a panel (two 8-float vectors); the library is refused if it says otherwise


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = load_kernel(SOURCE)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.panel_gemm_f32.restype = ctypes.c_int
    lib.panel_gemm_f32.argtypes = [p, i64, p, p, p, i64, i64, i64, ctypes.c_int]
    lib.panel_gemm_bf16.restype = ctypes.c_int
    lib.panel_gemm_bf16.argtypes = [p, i64, p, p, p, p, i64, i64, i64, ctypes.c_int]
    lib.panel_width.restype = ctypes.c_int
    lib.panel_tile_rows.restype = ctypes.c_int
    if lib.panel_width() != PANEL:  # weights packed to another width would be read wrongly
        raise RuntimeError(f"{SOURCE.name} packs {lib.panel_width()} columns a panel, panel_gemm.py {PANEL}")
    return lib


def available() -> bool:
    """Whether the kernel is built and loaded (tried once per process)."""
    return _library() is not None


@functools.lru_cache(maxsize=None)
def few_rows() -> int:
    """Up to this many rows a linear runs here rather than on oneDNN: 32 where the kernel built
    with AVX-512 (a 16-row tile: 1.1-1.5x oneDNN from 8 to 32 rows on all the real-shape model's
    linears, AMD EPYC with AVX-512, docs/benchmarks/engine.md), 16 with AVX2's 6-row tile (it drew
    level with oneDNN at 16-32); 16 when it did not build (the callers then never use it)."""
    lib = _library()
    return 32 if lib is not None and lib.panel_tile_rows() >= 16 else 16


def pack(weight: torch.Tensor) -> torch.Tensor:
    """nn.Linear weight [out, in] -> panels [ceil(out / 16), in, 16], the last one zero-padded."""
    out, n_in = weight.shape
    w_t = F.pad(weight.detach().t(), (0, -out % PANEL))  # [in, out padded to 16]
    return w_t.reshape(n_in, -1, PANEL).permute(1, 0, 2).contiguous()  # [P, in, 16]


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [m, in] (rows may lie apart; the last dim dense) -> [m, out_features], in the panels' dtype
    (fp32, or bf16 with x and bias bf16 too). Runs without the GIL."""
    m, n_in = x.shape
    dtype = panels.dtype
    assert dtype in (torch.float32, torch.bfloat16) and x.dtype == dtype and x.stride(1) == 1
    assert panels.shape[1] == n_in and panels.is_contiguous()
    assert bias is None or (bias.dtype == dtype and bias.is_contiguous())
    y = torch.empty(m, out_features, dtype=dtype)
    lib = built(_library())
    bias_ptr = None if bias is None else bias.data_ptr()
    if dtype == torch.float32:
        lib.panel_gemm_f32(
            x.data_ptr(),
            x.stride(0),
            panels.data_ptr(),
            bias_ptr,
            y.data_ptr(),
            m,
            n_in,
            out_features,
            torch.get_num_threads(),
        )
    else:
        widened = torch.empty(m, n_in, dtype=torch.float32)  # x in fp32, filled by the kernel
        lib.panel_gemm_bf16(
            x.data_ptr(),
            x.stride(0),
            panels.data_ptr(),
            bias_ptr,
            y.data_ptr(),
            widened.data_ptr(),
            m,
            n_in,
            out_features,
            torch.get_num_threads(),
        )
    return y
