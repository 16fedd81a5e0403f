"""Dispatch: Triton kernels for CUDA tensors (when triton imports); on the CPU, decode
sequences and prefill chunks go to their C kernels (kernels/cpu_native.py: both read KV in
place) when they built, and to pure torch when they did not.

CPU prefill chunks take the first of `CPU_PREFILL_KERNELS` that takes their shapes: the flash
kernel (full vector width: head_dim a multiple of 16 with AVX-512, of 8 with AVX2), then the
older tiled one (head_dim a multiple of 8), then torch. Measured per case by
`python -m pdserve.bench.prefill_attention` (docs/benchmarks/prefill_attention.md): the flash
kernel was the fastest of the three and of torch's flash SDPA on every case, so no case goes to
SDPA by choice.

Per-layer options (`paged_attention(window=, softcap=)`): a sliding window (HF semantics: the
query at position p sees keys at positions > p - window) and tanh soft-capping of the scores
(Gemma 2). Every path takes both (the C and Triton kernels skip the blocks before a window).

`PDSERVE_ATTENTION=torch|triton` overrides (`auto` or unset: the default; `torch`: pure torch
everywhere, the reference). Triton on CPU tensors needs TRITON_INTERPRET=1 set before triton is
first imported.

A quantized pool (`--kv-cache-dtype int8|fp8`: rows of int8 or e4m3 values and their fp32 scale,
kernels/kv_quant.py) is written by torch's quantizing store on every device (one set of bytes);
the C kernels read the rows as stored (decode: dequantized in registers; flash prefill: a tile at
a time) with fp32 sums, the Triton kernels likewise (each row widened and scaled in registers,
fp32 dots), and torch dequantizes what it gathers. The older tiled prefill kernel takes no
quantized pool.
"""

from __future__ import annotations

import functools

import torch

from pdserve.env import settings
from pdserve.kernels import cpu_native, kv_quant, torch_attention
from pdserve.kernels.metadata import AttentionMetadata


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """Whether `triton` imports (tried once, on the first CUDA call)."""
    try:
        import triton  # noqa: F401
    except Exception:  # not installed, or broken (no driver, ...): fall back to torch
        return False
    return True


# In order of preference: the first that takes a batch's shapes runs its prefill chunks.
CPU_PREFILL_KERNELS = (cpu_native.FLASH_SOURCE, cpu_native.PREFILL_SOURCE)


def _choice() -> str:
    return settings().attention  # PDSERVE_ATTENTION, read once (pdserve/env.py)


def use_triton(t: torch.Tensor, choice: str | None = None) -> bool:
    """The backend for tensor `t`: env override (`choice`, read now if not given), else Triton on
    CUDA when triton is installed."""
    choice = _choice() if choice is None else choice
    if choice == "torch":
        return False
    if choice == "triton":
        return True
    return t.is_cuda and triton_available()


def _native_decode(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    choice: str,
    window: int | None,
    softcap: float | None,
) -> bool:
    """Decode sequences through the C kernel when allowed and it can take them."""
    nd = meta.num_decode_seqs
    if not nd or choice not in ("", "auto") or not cpu_native.can_run(query, kv_layer):
        return False
    return cpu_native.paged_decode_attention(
        query[:nd], kv_layer, meta.block_tables, meta.context_lens, scale, out[:nd], window, softcap
    )


def _native_prefill(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    choice: str,
    window: int | None,
    softcap: float | None,
) -> bool:
    """Prefill chunks through the C kernel when allowed and it can take them (their K/V is
    already in the pool: the model stores a layer's KV before attending)."""
    if meta.num_decode_seqs == meta.num_seqs:
        return True
    if choice not in ("", "auto"):
        return False
    for source in CPU_PREFILL_KERNELS:
        if cpu_native.can_run_prefill(query, kv_layer, source) and cpu_native.paged_prefill_attention(
            query,
            kv_layer,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.context_lens,
            meta.num_decode_seqs,
            scale,
            out,
            source,
            window=window,
            softcap=softcap,
        ):
            return True
    return False


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into kv_layer [2, N, bs, Hkv, D] at slots [T] int64 (-1 = skip);
    a quantized pool [2, N, bs, Hkv, D + 4] takes them quantized (a scale per token and head)."""
    if use_triton(key) and not kv_quant.is_quantized(kv_layer):
        from pdserve.kernels import triton_attention

        return triton_attention.store_kv(key, value, kv_layer, slot_mapping)
    return torch_attention.store_kv(key, value, kv_layer, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [T, Hq, D], this step's key/value [T, Hkv, D] (already stored) -> out [T, Hq, D].
    `window`: this layer's sliding window (None: full attention); `softcap`: score soft-capping."""
    choice = _choice()  # read once per call
    if use_triton(query, choice):
        from pdserve.kernels import triton_attention

        return triton_attention.paged_attention(
            query, key, value, kv_layer, meta, scale, window=window, softcap=softcap
        )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, Hq, D]
    if not _native_decode(query, kv_layer, meta, scale, out, choice, window, softcap):
        torch_attention.attend_decodes(query, kv_layer, meta, scale, out, window, softcap)
    if not _native_prefill(query, kv_layer, meta, scale, out, choice, window, softcap):
        torch_attention.attend_prefills(query, key, value, kv_layer, meta, scale, out, window, softcap)
    return out
