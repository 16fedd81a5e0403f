"""A small-batch decode step's decoder layers in one C call (kernels/cpu_decode_layers.c).

The driver calls the same kernels as the per-op path (kernels/layer_ops.py, panel_gemm.py and
the decode attention of cpu_native.py), in the same order, so its output is bit for bit theirs;
it saves the Python between them (0.3-1.9 ms of a 6.3-7.6 ms batch-1 step of the bench model,
A/B in docs/benchmarks/engine.md). The model
decides when it applies (engine/models/llama.py: `LlamaForCausalLM.fused_decode`, on the
layers `describe_decode_layers` described once per KV pool);
`PDSERVE_FUSED_DECODE=off` keeps it off.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from pdserve.env import settings
from pdserve.kernels import block_gemm, cpu_native, layer_ops, panel_gemm, quant_gemm
from pdserve.kernels.block_gemm import BlockWeight
from pdserve.kernels.cpu_native import built, load_kernel
from pdserve.kernels.quant_gemm import QuantWeight

SOURCE = Path(__file__).with_name("cpu_decode_layers.c")
SLOT_PAST_POOL, ATTENTION_REFUSED, LINEAR_REFUSED = -1, -2, -3


class KernelTable(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in (
            "rmsnorm",
            "add_rmsnorm",
            "silu_mul",
            "rope_store",
            "attention",
            "gemm",
            "quant_gemm",
            "quant_gemm_int8x",
            "block_gemm",
        )
    ]


class QuantSegment(ctypes.Structure):
    """Rows [out0, out0 + out) of a quantized linear, in one format: the group-wise one
    (kernels/quant_gemm.QuantWeight) or a GGUF file's blocks (`qtype` set: block_gemm.BlockWeight)."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("offsets", ctypes.c_void_p),
        ("out0", ctypes.c_int64),
        ("out", ctypes.c_int64),
        ("bits", ctypes.c_int32),
        ("sg", ctypes.c_int32),
        ("qtype", ctypes.c_int32),
    ]


class LinearDesc(ctypes.Structure):
    """A linear for the driver: fp32 panels (`panels` set), or quantized row segments."""

    _fields_ = [
        ("panels", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("segments", ctypes.POINTER(QuantSegment)),
        ("num_segments", ctypes.c_int32),
        ("int8_activations", ctypes.c_int32),
    ]


class LayerWeights(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_attention_norm", ctypes.c_void_p),
        ("qkv", LinearDesc),
        ("o", LinearDesc),
        ("gate_up", LinearDesc),
        ("down", LinearDesc),
        ("kv", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),  # Qwen3's per-head norms [D], or None
        ("k_norm", ctypes.c_void_p),
    ]


def panel_linear(panels: torch.Tensor, bias: torch.Tensor | None) -> LinearDesc:
    """An fp32 linear by its few-row panels (engine/models/cpu_linear.py PackedLinear)."""
    return LinearDesc(panels.data_ptr(), None if bias is None else bias.data_ptr(), None, 0, 0)


def quant_linear(
    parts: list[QuantWeight | BlockWeight], bias: torch.Tensor | None, int8_activations: bool = False
) -> tuple[LinearDesc, ctypes.Array] | None:
    """A quantized linear by its parts (models/quantized_linear.py QuantizedLinear), with the
    segment array it points into (keep it alive); None when a part's rows carry input padding
    (the per-op path pads x; the driver does not) or a kernel it needs is not built."""
    if any(p.padded_in != p.in_features for p in parts):
        return None
    grouped = [p for p in parts if isinstance(p, QuantWeight)]
    if grouped and int8_activations and not quant_gemm.int8x_available():
        return None
    if len(grouped) < len(parts) and not block_gemm.available():
        return None
    segments = (QuantSegment * len(parts))()
    out0 = 0
    for seg, p in zip(segments, parts):
        if isinstance(p, BlockWeight):
            seg.q, seg.scales, seg.offsets, seg.bits, seg.sg, seg.qtype = p.blocks.data_ptr(), None, None, 0, 0, p.qtype
        else:
            offsets = None if p.offsets is None else p.offsets.data_ptr()
            seg.q, seg.scales, seg.offsets = p.q.data_ptr(), p.scales.data_ptr(), offsets
            seg.bits, seg.sg, seg.qtype = p.bits, p.scale_group, 0
        seg.out0, seg.out = out0, p.out_features
        out0 += p.out_features
    desc = LinearDesc(None, None if bias is None else bias.data_ptr(), segments, len(parts), int(int8_activations))
    return desc, segments


class StackShape(ctypes.Structure):
    _fields_ = [
        ("hidden", ctypes.c_int64),
        ("intermediate", ctypes.c_int64),
        ("hq", ctypes.c_int32),
        ("hkv", ctypes.c_int32),
        ("d", ctypes.c_int32),
        ("block_size", ctypes.c_int32),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
    ]


def _address(lib: ctypes.CDLL, name: str) -> int | None:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value


@functools.lru_cache(maxsize=None)
def _library() -> tuple[ctypes.CDLL, dict[torch.dtype, KernelTable]] | None:
    """The driver and the tables of kernels it calls, by the KV pool's dtype (fp32; int8 or fp8
    rows: their store and attention entries); None when any of them did not build."""
    ops, gemm, attention = layer_ops._library(), panel_gemm._library(), cpu_native._library()
    if not (ops and gemm and attention):
        return None
    quant, int8x = quant_gemm._library(), quant_gemm._int8x_library()  # optional: only quantized layers need them
    blocks = block_gemm._library()
    lib = load_kernel(SOURCE)
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.decode_layers_work_floats.restype = i64
    lib.decode_layers_work_floats.argtypes = [p, i64]
    lib.decode_layers_f32.restype = ctypes.c_int
    lib.decode_layers_f32.argtypes = [p, p, ctypes.c_int, p, p, p, i64, p, p, p, i64, p, i64, p, p, ctypes.c_int]

    def table(rope_store: str, decode_attention: str) -> KernelTable:
        return KernelTable(
            _address(ops, "rmsnorm_f32"),
            _address(ops, "add_rmsnorm_f32"),
            _address(ops, "silu_mul_f32"),
            _address(ops, rope_store),
            _address(attention, decode_attention),
            _address(gemm, "panel_gemm_f32"),
            _address(quant, "quant_gemm_f32") if quant is not None else None,
            _address(int8x, "quant_gemm_int8x") if int8x is not None else None,
            _address(blocks, "block_gemm_int8x") if blocks is not None else None,
        )

    return lib, {
        torch.float32: table("rope_store_f32", "paged_decode_attention_f32"),
        torch.int8: table("rope_store_q8", "paged_decode_attention_q8"),  # --kv-cache-dtype int8
        torch.uint8: table("rope_store_f8", "paged_decode_attention_f8"),  # --kv-cache-dtype fp8 (e4m3 rows)
    }


def quantized_available() -> bool:
    """Whether the driver can run quantized linears (a quantized GEMM built too)."""
    lib = _library()
    table = lib[1][torch.float32] if lib is not None else None
    return table is not None and (table.quant_gemm is not None or table.block_gemm is not None)


def available() -> bool:
    """Whether the driver and every kernel it calls are built and loaded (tried once per process)."""
    return _library() is not None


def enabled() -> bool:
    """No switch sends the driver, or any of its kernels, to torch (pdserve/env.py)."""
    s = settings()
    return s.fused_decode and s.layer_ops != "torch" and s.attention == "auto"


class DecodeLayers:
    """The decoder layers of one model over one KV pool, described once for the driver.
    Weights and pool must not move afterwards (they are laid out once, after loading)."""

    def __init__(
        self,
        layers: list[LayerWeights],
        kv_cache: torch.Tensor,
        shape: StackShape,
        keep: list | None = None,
        max_rows: int = 16,
    ) -> None:
        self.layers = (LayerWeights * len(layers))(*layers)
        self.max_rows = max_rows  # the most decode rows a step it runs may have (the model's rule)
        self._keep = keep or []  # ctypes arrays the layers point into (quantized segments)
        # [L, 2, N, bs, Hkv, D] fp32, or int8 / uint8 (fp8) rows of D + 4: held, so the layers' pool pointers stay valid
        self.kv_cache = kv_cache
        self.shape = shape
        self.slots = kv_cache.shape[2] * kv_cache.shape[3]
        lib = built(_library())[0]
        self.work_floats_per_row = lib.decode_layers_work_floats(ctypes.byref(shape), 1)  # scratch is per row

    def run(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> torch.Tensor | None:
        """x [m, H] (m decode rows) -> [m, H] after every layer, each layer's K, V stored at
        slot_mapping [m]; cos, sin [m, 1, D]; block_tables [>=m, W], context_lens [>=m] int32.
        None when the attention kernel refuses these shapes (the per-op path runs instead)."""
        lib, tables = built(_library())
        table = tables[self.kv_cache.dtype]
        m, hidden = x.shape
        assert x.is_contiguous() and hidden == self.shape.hidden and slot_mapping.dtype == torch.int64
        assert cos.is_contiguous() and sin.is_contiguous() and slot_mapping.is_contiguous()
        assert block_tables.is_contiguous() and context_lens.is_contiguous()
        work = torch.empty(self.work_floats_per_row * m, dtype=torch.float32)
        out = torch.empty(m, hidden, dtype=torch.float32)
        rc = lib.decode_layers_f32(
            ctypes.byref(table),
            self.layers,
            len(self.layers),
            ctypes.byref(self.shape),
            x.data_ptr(),
            out.data_ptr(),
            m,
            cos.data_ptr(),
            sin.data_ptr(),
            slot_mapping.data_ptr(),
            self.slots,
            block_tables.data_ptr(),
            block_tables.stride(0),
            context_lens.data_ptr(),
            work.data_ptr(),
            torch.get_num_threads(),
        )
        if rc == SLOT_PAST_POOL:
            raise IndexError(f"slot_mapping holds a slot past the KV pool ({self.slots} slots)")
        return None if rc in (ATTENTION_REFUSED, LINEAR_REFUSED) else out
