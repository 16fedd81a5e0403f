"""Linears on a GGUF file's blocks as the file stores them (kernels/cpu_block_dot.c): Q4_K, Q5_K,
Q6_K and Q8_0, read in place from the memory-mapped file (no copy: workers mapping one file share
its pages), with int8 activations as llama.cpp multiplies them.

`BlockWeight` is such a tensor: `blocks` uint8 [out, in / 256 * bytes a super-block]. `linear`
runs the C kernel for any number of rows (x quantized per 256 inputs, integer dot products on
weight rows kept in cache over tiles of x's rows): at 256 prompt rows it ran ~2x faster than
widening the blocks to fp32 for oneDNN's GEMM (Q4_K and Q6_K, 2048 x 2048, one thread, loaded AVX2
machine), and a row's result does not depend on how many rows share its call, so a prompt's KV is
the same however it is chunked. `dequantize_rows` widens rows exactly as ggml (embedding lookups).

`linear_bf16` multiplies a prompt's rows in bf16 instead (kernels/cpu_block_bf16.c: x and the
widened weight rounded to bf16, panel by panel): on a CPU with AVX-512 BF16 (`bf16_native`) it ran
2.2x the int8 kernel's products a core from 256 rows (Q4_K, 2048 x 8192 and 8192 x 2048, one
thread, Zen 5), 1.2x at 16 rows; a row's result again depends on no other row.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.kernels.cpu_native import built, load_kernel
from pdserve.kernels.quant_gemm import check_rc

SOURCE = Path(__file__).with_name("cpu_block_dot.c")
BF16_SOURCE = Path(__file__).with_name("cpu_block_bf16.c")
SUPER_BLOCK = 256  # inputs a super-block: in_features must be a multiple
# ggml type id -> (name, bytes per 256 inputs)
TYPES = {8: ("Q8_0", 8 * 34), 12: ("Q4_K", 144), 13: ("Q5_K", 176), 14: ("Q6_K", 210)}


@dataclass(frozen=True)
class BlockWeight:
    """A linear weight [out_features, in_features] as a GGUF file stores it (rows of whole blocks)."""

    qtype: int  # ggml's type id (TYPES)
    blocks: torch.Tensor  # uint8 [out, in / 256 * TYPES[qtype][1]]
    in_features: int

    def __post_init__(self) -> None:
        if self.qtype not in TYPES:
            raise ValueError(
                f"GGUF type {self.qtype} is not read as blocks (read: {', '.join(n for n, _ in TYPES.values())})"
            )
        if (
            self.in_features % SUPER_BLOCK
            or self.blocks.shape[1] != self.in_features // SUPER_BLOCK * TYPES[self.qtype][1]
        ):
            raise ValueError(
                f"blocks {tuple(self.blocks.shape)} do not hold {self.in_features} {self.name} inputs a row"
            )

    @property
    def name(self) -> str:
        return TYPES[self.qtype][0]

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def padded_in(self) -> int:
        return self.in_features

    def nbytes(self) -> int:
        return self.blocks.numel()


def readable(qtype: int, in_features: int) -> bool:
    """Whether a tensor of this type and row length can be served as its blocks."""
    return qtype in TYPES and in_features % SUPER_BLOCK == 0


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL | None:
    lib = load_kernel(SOURCE)
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.block_gemm_int8x.restype = i32
    lib.block_gemm_int8x.argtypes = [p, i64, p, p, p, i64, i64, i64, i32, i32]
    lib.moe_int8x.restype = i32
    lib.moe_int8x.argtypes = [p, i64, i64, i64, i64, p, p, p, p, p, p, i32, i32, i32, p, i32]
    lib.moe_routed_int8x.restype = i32
    lib.moe_routed_int8x.argtypes = [p, i64, i64, i64, i64, i64, p, p, p, p, p, i32, i32, i32, p, i32]
    lib.block_dequant_f32.restype = i32
    lib.block_dequant_f32.argtypes = [p, p, i64, i64, i64, i32, p, i32]
    lib.block_bytes_per_256.restype = i64
    lib.block_bytes_per_256.argtypes = [i32]
    for qtype, (name, size) in TYPES.items():
        if lib.block_bytes_per_256(qtype) != size:
            raise RuntimeError(
                f"{SOURCE.name} reads {name} as {lib.block_bytes_per_256(qtype)} bytes, block_gemm.py {size}"
            )
    return lib


@functools.lru_cache(maxsize=None)
def _bf16_library() -> ctypes.CDLL | None:
    lib = load_kernel(BF16_SOURCE)
    if lib is None:
        return None
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.block_gemm_bf16.restype = i32
    lib.block_gemm_bf16.argtypes = [p, i64, p, p, p, i64, i64, i64, i64, i32, i32]
    lib.block_bf16_native.restype = i32
    lib.block_bf16_native.argtypes = []
    return lib


def bf16_native() -> bool:
    """Whether `linear_bf16` runs on the CPU's own bf16 products (a build with AVX-512 BF16); any
    other build computes the same bits in fp32 multiply-adds, slower than the int8 kernel."""
    lib = _bf16_library()
    return lib is not None and bool(lib.block_bf16_native())


def available() -> bool:
    """Whether the kernel is built and loaded (tried once per process)."""
    return _library() is not None


def dequantize_rows(
    w: BlockWeight, ids: torch.Tensor | None = None, o0: int = 0, o1: int | None = None
) -> torch.Tensor:
    """Rows `ids` (int64 [n]; None: rows o0..o1) widened to fp32 [n, in], as ggml dequantizes them."""
    if ids is not None:
        ids = ids.to(torch.int64).contiguous()
        n = ids.numel()
    else:
        n = (w.out_features if o1 is None else o1) - o0
    dense = torch.empty(n, w.in_features, dtype=torch.float32)
    rc = built(_library()).block_dequant_f32(
        w.blocks.data_ptr(),
        None if ids is None else ids.data_ptr(),
        o0,
        n,
        w.in_features,
        w.qtype,
        dense.data_ptr(),
        torch.get_num_threads(),
    )
    check_rc(rc, "block_gemm")
    return dense


def linear(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [m, in] fp32 CPU (the last dim dense) -> [m, out] fp32 (callers check `available()`)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    assert x.dtype == torch.float32 and x.shape[1] == w.in_features
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=torch.float32)
    rc = built(_library()).block_gemm_int8x(
        x.data_ptr(),
        x.stride(0),
        w.blocks.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        m,
        w.in_features,
        w.out_features,
        w.qtype,
        torch.get_num_threads(),
    )
    check_rc(rc, "block_gemm")
    return y


def linear_bf16(
    x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`linear` with x and the widened weight rounded to bf16 (products exact, summed in fp32 in a
    fixed order): x [m, in] fp32 CPU -> [m, out] fp32, written into `out` when given (a view whose
    rows are dense, e.g. a fused linear's columns of one part)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    assert x.dtype == torch.float32 and x.shape[1] == w.in_features
    assert bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())
    m = x.shape[0]
    y = torch.empty(m, w.out_features, dtype=torch.float32) if out is None else out
    assert y.dtype == torch.float32 and y.shape == (m, w.out_features) and y.stride(1) == 1
    rc = built(_bf16_library()).block_gemm_bf16(
        x.data_ptr(),
        x.stride(0),
        w.blocks.data_ptr(),
        None if bias is None else bias.data_ptr(),
        y.data_ptr(),
        y.stride(0),
        m,
        w.in_features,
        w.out_features,
        w.qtype,
        torch.get_num_threads(),
    )
    check_rc(rc, "block_gemm_bf16")
    return y


class ExpertBlocks:
    """A mixture layer's experts as the file's blocks, for `moe_routed`: per expert (None: not held
    here) its gate and up [inter, hidden] and down [hidden, inter] weights, one type a kind."""

    def __init__(
        self, gate: list[BlockWeight | None], up: list[BlockWeight | None], down: list[BlockWeight | None]
    ) -> None:
        held = [i for i, g in enumerate(gate) if g is not None]
        if not held:
            raise ValueError("no expert's blocks")
        for kind in (gate, up, down):
            if len({(w.qtype, w.in_features, w.out_features) for w in kind if w is not None}) != 1:
                raise ValueError("every expert's weight of a kind must have one type and shape")
            if [i for i, w in enumerate(kind) if w is not None] != held:
                raise ValueError("gate, up and down must be held for the same experts")
        g, u, d = gate[held[0]], up[held[0]], down[held[0]]
        assert g is not None and u is not None and d is not None
        self.hidden, self.inter = g.in_features, g.out_features
        if (u.in_features, u.out_features, d.in_features, d.out_features) != (
            self.hidden,
            self.inter,
            self.inter,
            self.hidden,
        ):
            raise ValueError(
                f"gate {self.inter}x{self.hidden}, up {u.out_features}x{u.in_features}, down not its transpose"
            )
        self.num_experts = len(gate)
        self.types = (g.qtype, u.qtype, d.qtype)
        self.keep = (gate, up, down)  # the blocks the addresses below point into
        self.pointers = tuple(  # ctypes arrays of each kind's block addresses (NULL: not held)
            (ctypes.c_void_p * len(kind))(*[None if w is None else w.blocks.data_ptr() for w in kind])
            for kind in (gate, up, down)
        )


def moe_routed(x: torch.Tensor, experts: ExpertBlocks, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A mixture of experts over a step (kernels/cpu_block_dot.c `moe_routed_int8x`): x [T, hidden]
    fp32, the router's choices as it gives them: chosen [T, k] experts (int64) and their routing
    weights [T, k] (fp32), grouped by expert in C. -> [T, hidden] fp32."""
    x = x.contiguous()
    assert x.dtype == torch.float32 and x.shape[1] == experts.hidden
    assert chosen.dtype == torch.int64 and weights.dtype == torch.float32 and chosen.shape == weights.shape
    chosen, weights = chosen.contiguous(), weights.contiguous()
    out = torch.empty_like(x)
    gate, up, down = experts.pointers
    rc = built(_library()).moe_routed_int8x(
        x.data_ptr(),
        x.shape[0],
        experts.hidden,
        experts.inter,
        experts.num_experts,
        chosen.shape[1],
        chosen.data_ptr(),
        weights.data_ptr(),
        ctypes.cast(gate, ctypes.c_void_p),
        ctypes.cast(up, ctypes.c_void_p),
        ctypes.cast(down, ctypes.c_void_p),
        *experts.types,
        out.data_ptr(),
        torch.get_num_threads(),
    )
    check_rc(rc, "block_gemm")
    return out
