"""Weight-only int8 / int4 linears (kernels/cpu_quant_gemm.c): the group-wise format, its torch
reference, and the C kernels.

Format (`QuantWeight`): W [out, in] in groups of 32 consecutive inputs, one fp32 scale per
`scale_group` inputs (32, or 16 for GGUF's Q6_K), so GGUF's blocks map onto it as they are
(their fp16 scales widened exactly): int8 `q` [out, in] holds w / d; int4 `q` [out, in / 2]
holds 16 bytes a group, byte j = element j (low nibble) | element j + 16 (high nibble),
w = (nibble - 8) * d. Affine weights (`offsets`, one per scale: GGUF's Q4_1, Q4_K, Q5_K) are
w = q * d + m, int4's nibble taken as it is (0..15). Rows are padded to whole groups with zeros.

`linear`: up to FEW_ROWS rows (48 int4, 64 int8: decode steps) go to the C kernel (each weight
read once a tile of rows, widened in registers); more rows (prefill) widen TILE_OUT output rows at a time to fp32 (in C: ~5% of the GEMM's time
at 256 rows) and multiply with torch's oneDNN GEMM (MKL's without oneDNN). Without the C library everything runs on the torch reference.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.kernels.cpu_native import built, load_kernel

SOURCE = Path(__file__).with_name("cpu_quant_gemm.c")
INT8X_SOURCE = Path(__file__).with_name("cpu_quant_dot.c")  # the same formats, int8 activations
GROUP = 32  # inputs a scale; the library is refused if it says otherwise
BITS = {"int8": 8, "int4": 4}
# Up to this many rows (by bits) the C kernel; beyond, widened tiles + torch's GEMM. The C kernel
# reads the weights once per tile of rows and costs ~rows; widening costs ~the weights once plus
# fp32's GEMM. Measured crossover (python -m pdserve.bench.quantized_linear --rows-sweep; real-shape
# linears and LM head): int4 48-64 rows on one thread, 64-96 on two; int8 64-96 / 96+.
FEW_ROWS = {4: 48, 8: 64}
PACK_ROWS_HINT = 32  # as engine/models/cpu_linear.py's oneDNN weights
TILE_OUT = 1024  # output rows widened at a time for many-row inputs (at in = 1536: 6 MB of fp32)


@dataclass(frozen=True)
class QuantWeight:
    """A linear weight [out_features, in_features] quantized group-wise (the module docstring)."""

    bits: int  # 8 or 4
    q: torch.Tensor  # int8 [out, G * 32] (bits 8) or uint8 [out, G * 16] (bits 4)
    scales: torch.Tensor  # fp32 [out, G * 32 / scale_group]
    in_features: int  # <= G * 32; the rest of each row is zero padding
    offsets: torch.Tensor | None = None  # fp32 like scales: affine, w = q * d + m (int4: nibble as is)
    scale_group: int = GROUP  # inputs a scale: 32, or 16

    def __post_init__(self) -> None:
        if self.scale_group not in (16, 32) or self.scales.shape[1] * self.scale_group != self.padded_in:
            raise ValueError(f"scales {tuple(self.scales.shape)} do not fit {self.padded_in} inputs a row")
        if self.offsets is not None and self.offsets.shape != self.scales.shape:
            raise ValueError("offsets must have the scales' shape")

    @property
    def out_features(self) -> int:
        return self.q.shape[0]

    @property
    def padded_in(self) -> int:
        return self.q.shape[1] * 8 // self.bits

    @property
    def affine(self) -> bool:
        return self.offsets is not None

    def nbytes(self) -> int:
        extra = [] if self.offsets is None else [self.offsets]
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, *extra))


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The torch reference: fp32 [out, in_features] (q * d, then + m when affine: ggml's order)."""
    out, groups = w.out_features, w.padded_in // GROUP
    if w.bits == 8:
        values = w.q.view(out, groups, GROUP).float()  # [out, G, 32]
    else:
        b = w.q.view(out, groups, GROUP // 2)  # [out, G, 16]
        values = (torch.cat([b & 15, b >> 4], dim=-1).to(torch.int8) - (0 if w.affine else 8)).float()  # [out, G, 32]
    values = values.view(out, -1, w.scale_group)  # [out, S, scale_group]
    weight = values * w.scales.unsqueeze(-1)
    if w.offsets is not None:
        weight = weight + w.offsets.unsqueeze(-1)
    return weight.reshape(out, -1)[:, : w.in_features]


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = load_kernel(SOURCE)
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quant_gemm_f32.restype = i32
    lib.quant_gemm_f32.argtypes = [p, i64, p, p, p, p, p, i64, i64, i64, i32, i32, i32]
    lib.quant_dequant_f32.restype = i32
    lib.quant_dequant_f32.argtypes = [p, p, p, p, i64, i64, i64, i32, i32, i32]
    lib.quant_group.restype = i32
    if lib.quant_group() != GROUP:
        raise RuntimeError(f"{SOURCE.name} groups {lib.quant_group()} inputs a scale, quant_gemm.py {GROUP}")
    return lib


@functools.lru_cache(maxsize=None)
def _int8x_library() -> ctypes.CDLL | None:
    lib = load_kernel(INT8X_SOURCE)
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.quant_gemm_int8x.restype = i32
    lib.quant_gemm_int8x.argtypes = [p, i64, p, p, p, p, p, i64, i64, i64, i32, i32, i32]
    lib.quant_dot_group.restype = i32
    if lib.quant_dot_group() != GROUP:
        raise RuntimeError(f"{INT8X_SOURCE.name} groups {lib.quant_dot_group()} inputs a scale, quant_gemm.py {GROUP}")
    return lib


def available() -> bool:
    """Whether the kernels are built and loaded (tried once per process)."""
    return _library() is not None


def int8x_available() -> bool:
    """Whether the int8-activation kernel is built and loaded (tried once per process)."""
    return _int8x_library() is not None


def check_rc(rc: int, kernel: str = "quant_gemm") -> None:
    """A kernel's return code: 0 ok, -2 out of memory (its quantized activations), else bad arguments."""
    if rc == -2:
        raise MemoryError(f"{kernel}: no memory for the quantized activations")
    if rc != 0:
        raise ValueError(f"{kernel}: bad arguments")


def widen_rows(w: QuantWeight, o0: int, o1: int) -> torch.Tensor:
    """Output rows [o0, o1) as fp32 [o1 - o0, padded_in], in C (callers check `available()`)."""
    dense = torch.empty(o1 - o0, w.padded_in, dtype=torch.float32)
    rc = built(_library()).quant_dequant_f32(
        w.q.data_ptr(),
        w.scales.data_ptr(),
        None if w.offsets is None else w.offsets.data_ptr(),
        dense.data_ptr(),
        w.padded_in,
        o0,
        o1,
        w.bits,
        w.scale_group,
        torch.get_num_threads(),
    )
    check_rc(rc)
    return dense


def _dense_linear(x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, in] . dense [o, in]^T: on oneDNN, the tile reordered into its blocked layout first
    (reorder + GEMM ran 1.2-2.4x faster than MKL's GEMM on the tile here, 256 rows, one thread)."""
    if torch.backends.mkldnn.is_available():
        packed = torch.ops.mkldnn._reorder_linear_weight(dense, PACK_ROWS_HINT)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # [m, o]
    return F.linear(x, dense, bias)  # [m, o]


def linear(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None, int8_activations: bool = False) -> torch.Tensor:
    """x [m, in] fp32 CPU (the last dim dense; rows may lie apart) -> [m, out] fp32.
    `int8_activations`: few-row calls quantize x's rows per group of 32 and multiply in integers
    (kernels/cpu_quant_dot.c; as llama.cpp's dot products); many-row calls are unchanged."""
    m = x.shape[0]
    if not available():
        return F.linear(x, dequantize(w), bias)  # [m, out]
    if x.shape[1] != w.padded_in:
        x = F.pad(x, (0, w.padded_in - x.shape[1]))  # [m, padded_in]: zeros meet the zero padding
    elif x.stride(1) != 1:
        x = x.contiguous()
    assert x.dtype == torch.float32 and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
    if m <= FEW_ROWS[w.bits]:
        y = torch.empty(m, w.out_features, dtype=torch.float32)
        int8x = int8_activations and int8x_available()
        kernel = built(_int8x_library()).quant_gemm_int8x if int8x else built(_library()).quant_gemm_f32
        rc = kernel(
            x.data_ptr(),
            x.stride(0),
            w.q.data_ptr(),
            w.scales.data_ptr(),
            None if w.offsets is None else w.offsets.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            m,
            w.padded_in,
            w.out_features,
            w.bits,
            w.scale_group,
            torch.get_num_threads(),
        )
        check_rc(rc)
        return y
    tiles = []
    for o0 in range(0, w.out_features, TILE_OUT):
        o1 = min(o0 + TILE_OUT, w.out_features)
        tiles.append(_dense_linear(x, widen_rows(w, o0, o1), None if bias is None else bias[o0:o1]))  # [m, o1 - o0]
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)  # [m, out]
