"""Triton twins of `kernels.torch_attention` (same signatures): KV scatter and paged attention.

- `store_kv`: one program per token scatters its [Hkv, D] key and value rows to their slot.
- decode kernel: one program per (decode sequence, KV head, KV split). The G query heads sharing
  that KV head are the rows of one tile (padded to 16 for `tl.dot`), so each KV block is read
  once per KV head; loops over the block table `BLOCK_N` tokens at a time with online softmax.
  With few sequences the context is split (flash-decoding) so the whole GPU reads KV; each split
  writes a partial output and its log-sum-exp, and a small kernel combines them.
- prefill kernel: programs over (prefill sequence, query tile, query head); loops over KV tokens
  of the paged cache up to the tile's causal limit (bottom-right aligned), online softmax.

A quantized pool (`--kv-cache-dtype int8|fp8`, kernels/kv_quant.py) is read as it is stored:
each row's D bytes widened to fp32 and scaled by the row's fp32 scale in registers (`_kv_rows`),
dots in fp32; it is written by torch's quantizing store (kernels/attention.py), the same bytes as
on the CPU.

KV addresses are computed per token (`block_tables[b, n // bs] * bs + n % bs`), so any block
size works; head_dim is padded to a power of two with masks. Softmax runs in fp32 (exp2 with
log2(e) folded into the scale); fp32 inputs use IEEE fp32 dots (no TF32).

This module imports triton; `kernels.attention` imports it only when dispatching here, so
`import kernels` works without triton. On CPU tensors these kernels need TRITON_INTERPRET=1 set
before triton is first imported (tests/kernels/test_triton_kernels.py runs them in a subprocess).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.env import settings
from pdserve.kernels import kv_quant
from pdserve.kernels.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634
# a pool's dtype -> the kernels' QUANT (kernels/kv_quant.py's row formats; 0: values as stored)
QUANT_CODES = {kv_quant.INT8.pool_dtype: 1, kv_quant.FP8.pool_dtype: 2}


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    """a @ b with an fp32 accumulator; FP32: in IEEE fp32 (no TF32, and the interpreter's path)."""
    if FP32:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def _scaled(s, qk_scale, softcap, SOFTCAP: tl.constexpr):
    """Raw scores q.k -> the log2-domain scores the softmax takes: s * scale * log2(e), or with
    SOFTCAP softcap * tanh(s * scale / softcap) * log2(e) (tanh through exp: the interpreter has
    none); qk_scale is scale * log2(e)."""
    if SOFTCAP:
        x = s * (qk_scale * 0.6931471805599453) / softcap  # s * scale / softcap
        e = tl.exp(-2.0 * tl.abs(x))  # in (0, 1]: no overflow
        t = (1.0 - e) / (1.0 + e)
        return softcap * tl.where(x < 0, -t, t) * 1.4426950408889634
    return s * qk_scale


@triton.jit
def _kv_rows(ptr, base, offs_d, n_mask, d_mask, skv_d, D: tl.constexpr, QUANT: tl.constexpr):
    """K or V rows [BLOCK_N, BLOCK_D] of the pool at `base` [BLOCK_N] (each row's first element).
    QUANT 0: the pool's values as stored. 1 (int8) and 2 (fp8 e4m3, uint8 bits): rows of D one-byte
    values and their fp32 scale (kernels/kv_quant.py), widened and scaled to fp32 as
    `kv_quant.dequantize` does: e4m3 through its bits (exponent rebiased under fp32's, subnormals
    m * 2^-9), so the values are exact on every backend."""
    x = tl.load(ptr + base[:, None] + offs_d[None, :] * skv_d, mask=n_mask[:, None] & d_mask[None, :], other=0)
    if QUANT == 0:
        return x
    scale = tl.load((ptr + base + D).to(tl.pointer_type(tl.float32)), mask=n_mask, other=0.0)  # [BLOCK_N]
    if QUANT == 1:
        vals = x.to(tl.float32)
    else:
        bits = x.to(tl.int32)  # [0, 255]
        e = (bits >> 3) & 15
        m = bits & 7
        normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        vals = tl.where(bits >= 128, -mag, mag)
    return vals * scale[:, None]


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_ptr,
    sk_t,
    sk_h,
    sk_d,
    sv_t,
    sv_h,
    sv_d,
    skv_kv,
    skv_blk,
    skv_off,
    skv_h,
    skv_d,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D)
        t64 = t.to(tl.int64)
        k = tl.load(key_ptr + t64 * sk_t + offs_h[:, None] * sk_h + offs_d[None, :] * sk_d, mask=mask)
        v = tl.load(value_ptr + t64 * sv_t + offs_h[:, None] * sv_h + offs_d[None, :] * sv_d, mask=mask)
        dst = (
            kv_ptr + (slot // BS) * skv_blk + (slot % BS) * skv_off + offs_h[:, None] * skv_h + offs_d[None, :] * skv_d
        )
        tl.store(dst, k.to(kv_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + skv_kv, v.to(kv_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    cu_ptr,
    ctx_ptr,
    bt_ptr,
    qk_scale,
    chunk,
    part_ptr,
    lse_ptr,
    window,
    softcap,
    sq_t,
    sq_h,
    sq_d,
    so_t,
    so_h,
    so_d,
    skv_kv,
    skv_blk,
    skv_off,
    skv_h,
    skv_d,
    sbt_b,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32: tl.constexpr,
    SPLIT: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
):
    """One (decode sequence, KV head, KV split). SPLIT: this program covers KV positions
    [split * chunk, (split + 1) * chunk) and writes its normalised partial output to
    part [nd, Hq, S, D] and its log2-sum-exp to lse [nd, Hq, S] (combined by `_combine_splits`).
    WINDOW: only the last `window` positions are read (splits before them are empty); SOFTCAP:
    scores soft-capped (`_scaled`)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(cu_ptr + b).to(tl.int64)  # the sequence's only query token
    ctx = tl.load(ctx_ptr + b)
    kv_lo = split * chunk
    kv_hi = tl.minimum(ctx, kv_lo + chunk)
    if WINDOW:
        kv_lo = tl.maximum(kv_lo, ctx - window)  # the query (position ctx - 1) sees keys > ctx - 1 - window
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * G + offs_g  # [BLOCK_G] query heads of this KV head
    g_mask = offs_g < G
    d_mask = offs_d < D
    q = tl.load(
        q_ptr + row * sq_t + heads[:, None] * sq_h + offs_d[None, :] * sq_d,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * sbt_b
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + offs_n  # [BLOCK_N] token positions
        n_mask = n < kv_hi
        blk = tl.load(bt_row + n // BS, mask=n_mask, other=0).to(tl.int64)
        base = blk * skv_blk + (n % BS) * skv_off + kvh * skv_h  # [BLOCK_N]
        k = _kv_rows(kv_ptr, base, offs_d, n_mask, d_mask, skv_d, D, QUANT)  # [BLOCK_N, BLOCK_D]
        v = _kv_rows(kv_ptr + skv_kv, base, offs_d, n_mask, d_mask, skv_d, D, QUANT)
        s = _dot(q, tl.trans(k), FP32)
        s = tl.where(n_mask[None, :], _scaled(s, qk_scale, softcap, SOFTCAP), float("-inf"))  # [BLOCK_G, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32)
        m_i = m_new
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        num_splits = tl.num_programs(2)
        empty = kv_lo >= kv_hi  # a split past this sequence's end: weight 0 in the combine
        acc = tl.where(empty, 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))  # [BLOCK_G]
        slot = (b.to(tl.int64) * (G * tl.num_programs(1)) + heads) * num_splits + split  # [BLOCK_G]
        tl.store(part_ptr + slot[:, None] * D + offs_d[None, :], acc, mask=out_mask)
        tl.store(lse_ptr + slot, lse, mask=g_mask)
    else:
        acc = acc / l_i[:, None]
        tl.store(
            out_ptr + row * so_t + heads[:, None] * so_h + offs_d[None, :] * so_d,
            acc.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit
def _combine_splits_kernel(
    part_ptr, lse_ptr, out_ptr, so_t, so_h, so_d, S, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr
):
    """One (decode row, query head): out = sum_s 2^(lse_s - lse) * part_s over the KV splits."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < S
    slot = (b.to(tl.int64) * tl.num_programs(1) + h) * S + offs_s  # [BLOCK_S]
    lse = tl.load(lse_ptr + slot, mask=s_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # split 0 is never empty, so the max is finite
    w = w / tl.sum(w, 0)
    part = tl.load(
        part_ptr + slot[:, None] * D + offs_d[None, :], mask=s_mask[:, None] & (offs_d[None, :] < D), other=0.0
    )  # [BLOCK_S, BLOCK_D]
    acc = tl.sum(part * w[:, None], 0)  # [BLOCK_D]
    tl.store(
        out_ptr + b.to(tl.int64) * so_t + h * so_h + offs_d * so_d, acc.to(out_ptr.dtype.element_ty), mask=offs_d < D
    )


@triton.jit
def _prefill_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    cu_ptr,
    ctx_ptr,
    bt_ptr,
    qk_scale,
    first_seq,
    window,
    softcap,
    sq_t,
    sq_h,
    sq_d,
    so_t,
    so_h,
    so_d,
    skv_kv,
    skv_blk,
    skv_off,
    skv_h,
    skv_d,
    sbt_b,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    QUANT: tl.constexpr,
):
    """WINDOW: the query at position p sees keys > p - window, and keys before the tile's first
    query's window are not read; SOFTCAP as in `_decode_kernel`."""
    b = first_seq + tl.program_id(0)
    m0 = tl.program_id(1) * BLOCK_M
    h = tl.program_id(2)
    kvh = h // G
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    if m0 < q_len:
        ctx = tl.load(ctx_ptr + b)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        m_mask = offs_m < q_len
        d_mask = offs_d < D
        pos = ctx - q_len + offs_m  # [BLOCK_M] absolute positions of the queries
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(
            q_ptr + rows[:, None] * sq_t + h * sq_h + offs_d[None, :] * sq_d,
            mask=m_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_D]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = bt_ptr + b.to(tl.int64) * sbt_b
        kv_end = tl.minimum(ctx, ctx - q_len + m0 + BLOCK_M)  # causal limit of this tile
        kv_start = 0
        if WINDOW:
            kv_start = tl.maximum(0, ctx - q_len + m0 - window + 1)  # the tile's first query's window
        for start in range(kv_start, kv_end, BLOCK_N):
            n = start + offs_n  # [BLOCK_N]
            n_mask = n < kv_end
            blk = tl.load(bt_row + n // BS, mask=n_mask, other=0).to(tl.int64)
            base = blk * skv_blk + (n % BS) * skv_off + kvh * skv_h
            k = _kv_rows(kv_ptr, base, offs_d, n_mask, d_mask, skv_d, D, QUANT)  # [BLOCK_N, BLOCK_D]
            v = _kv_rows(kv_ptr + skv_kv, base, offs_d, n_mask, d_mask, skv_d, D, QUANT)
            s = _dot(q, tl.trans(k), FP32)
            keep = n_mask[None, :] & (n[None, :] <= pos[:, None])  # [BLOCK_M, BLOCK_N]
            if WINDOW:
                keep = keep & (n[None, :] > pos[:, None] - window)
            s = tl.where(keep, _scaled(s, qk_scale, softcap, SOFTCAP), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # Without a window KV 0 is visible to every row, so m_new is finite after the first
            # tile; with one a row may see nothing in a tile yet: keep its sums at 0, not NaN.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, FP32)
            m_i = m_new
        acc = acc / l_i[:, None]
        tl.store(
            out_ptr + rows[:, None] * so_t + h * so_h + offs_d[None, :] * so_d,
            acc.to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def _interpreting() -> bool:
    return settings().triton_interpret


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into kv_layer [2, N, bs, Hkv, D] at `slot_mapping` [T] (-1 = skip)."""
    t, hkv, d = key.shape
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        key,
        value,
        kv_layer,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        kv_layer.stride(4),
        HKV=hkv,
        D=d,
        BS=kv_layer.shape[2],
        BLOCK_H=_pow2(hkv),
        BLOCK_D=_pow2(d),
    )


def decode_block_n(head_dim: int) -> int:
    """KV positions per decode-loop iteration."""
    return 64 if _pow2(head_dim, 16) <= 64 else 32


def plan_decode_splits(max_ctx: int, block_n: int, wanted: int) -> tuple[int, int]:
    """(splits, chunk): `chunk` KV positions per split, a multiple of `block_n`; as many splits
    as `wanted` allows at that granularity (fewer for short contexts)."""
    chunk = triton.cdiv(triton.cdiv(max_ctx, max(1, wanted)), block_n) * block_n
    return triton.cdiv(max_ctx, chunk), chunk


def _auto_splits(programs: int, max_ctx: int, device: torch.device) -> int:
    """KV splits per decode sequence (flash-decoding): enough programs to fill the GPU twice
    over when there are few sequences, none below 512 KV positions per split (below that the
    extra launch costs more than the parallelism gains; measured in docs/benchmarks/gpu.md)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), max_ctx // 512))


def default_prefill_tiles(block_d: int, max_q: int, fp32: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the prefill kernel. 16-bit: 64x64 tiles in 3
    stages (3.6x the old 32x16 on an H100 at D=128, docs/benchmarks/gpu.md); fp32 tiles are
    twice the bytes, so narrower KV tiles in 2 stages."""
    block_m = 64 if max_q > 32 else (32 if max_q > 16 else 16)
    if fp32:
        return block_m, (32 if block_d <= 64 else 16), 4, 2
    return block_m, 64, 4, 3


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    decode_splits: int | None = None,
    prefill_tiles: tuple[int, int, int, int] | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """query [T, Hq, D]; key/value [T, Hkv, D] (already stored, unused here) -> out [T, Hq, D];
    kv_layer [2, N, bs, Hkv, D], or [2, N, bs, Hkv, D + 4] of int8 / fp8 rows (read widened).
    `window`: a sliding window (keys before it are not read); `softcap`: scores soft-capped.
    `decode_splits`: KV splits per decode sequence (None: chosen from the GPU's size);
    `prefill_tiles`: (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of the defaults."""
    t, hq, d = query.shape
    out = torch.empty((t, hq, d), dtype=query.dtype, device=query.device)  # [T, Hq, D]
    if t == 0:
        return out
    hkv, bs = kv_layer.shape[3], kv_layer.shape[2]
    groups = hq // hkv
    block_d = _pow2(d, 16)
    # fp32 dots for fp32 inputs, for a quantized pool (its rows widen to fp32), and always under
    # the interpreter (its bf16 dot is wrong).
    quant = QUANT_CODES.get(kv_layer.dtype, 0)
    fp32_dot = query.dtype == torch.float32 or quant != 0 or _interpreting()
    qk_scale = scale * _LOG2E
    options = dict(WINDOW=bool(window), SOFTCAP=softcap is not None, QUANT=quant)
    extra = (window or 0, softcap or 1.0)  # window, softcap (runtime values; unused where off)
    strides = (
        *query.stride(),
        *out.stride(),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        kv_layer.stride(4),
        meta.block_tables.stride(0),
    )
    nd, num_seqs = meta.num_decode_seqs, meta.num_seqs
    if nd:
        block_n = decode_block_n(d)
        max_ctx = max(meta.context_lens_cpu[:nd])
        wanted = decode_splits if decode_splits is not None else _auto_splits(nd * hkv, max_ctx, query.device)
        splits, chunk = plan_decode_splits(max_ctx, block_n, wanted)
        part = lse = out  # unused unless split
        if splits > 1:
            part = torch.empty((nd, hq, splits, d), dtype=torch.float32, device=query.device)  # [nd, Hq, S, D]
            lse = torch.empty((nd, hq, splits), dtype=torch.float32, device=query.device)  # [nd, Hq, S]
        _decode_kernel[(nd, hkv, splits)](
            query,
            kv_layer,
            out,
            meta.cu_seqlens_q,
            meta.context_lens,
            meta.block_tables,
            qk_scale,
            chunk,
            part,
            lse,
            *extra,
            *strides,
            G=groups,
            D=d,
            BS=bs,
            BLOCK_G=_pow2(groups, 16),
            BLOCK_D=block_d,
            BLOCK_N=block_n,
            FP32=fp32_dot,
            SPLIT=splits > 1,
            **options,
        )
        if splits > 1:  # decodes are the first nd rows of `out`
            _combine_splits_kernel[(nd, hq)](
                part, lse, out, *out.stride(), splits, D=d, BLOCK_S=_pow2(splits), BLOCK_D=block_d
            )
    if num_seqs > nd:
        max_q = max(meta.cu_seqlens_q_cpu[b + 1] - meta.cu_seqlens_q_cpu[b] for b in range(nd, num_seqs))
        block_m, block_n, warps, stages = prefill_tiles or default_prefill_tiles(block_d, max_q, fp32_dot)
        grid = (num_seqs - nd, triton.cdiv(max_q, block_m), hq)
        _prefill_kernel[grid](
            query,
            kv_layer,
            out,
            meta.cu_seqlens_q,
            meta.context_lens,
            meta.block_tables,
            qk_scale,
            nd,
            *extra,
            *strides,
            G=groups,
            D=d,
            BS=bs,
            BLOCK_M=block_m,
            BLOCK_D=block_d,
            BLOCK_N=block_n,
            FP32=fp32_dot,
            num_warps=warps,
            num_stages=stages,
            **options,
        )
    return out
