"""Pure-torch paged attention and KV store: the reference for the C and Triton kernels, and the
CPU path where the C kernels did not build (or past their limits).

Decode sequences (one query each) are computed together, batched: their KV is gathered from the
paged pool into `[n, S, Hkv, D]` and attended with one masked SDPA call. The gather is done in
chunks of sequences of at most `DECODE_CHUNK_BYTES` of K+V, so the gathered copy stays in cache
and its allocation stays small (one huge gather then SDPA is ~3-5x slower on CPU). GQA is folded
into the query-length axis (`[n, Hkv, G, D]`): the G query heads sharing a KV head are G
"queries" at the same position, so no KV expansion is needed.

Prefill chunks go one sequence at a time (compute-bound: the loop costs nothing next to the
matmuls). A chunk with no earlier context uses its own fresh K/V with SDPA's causal mask; one with
earlier context reads its KV in place when its blocks form one run (the block pool places a
sequence's blocks so when it can), else gathers it from the pool and needs a bottom-right-aligned causal mask (SDPA's
`is_causal` is top-left aligned, wrong when kv_len > q_len):

    context c = 5, q_len = 3:  query i may see KV j <= c - q_len + i
        j: 0 1 2 3 4
    i=0    x x x . .
    i=1    x x x x .
    i=2    x x x x x

A sliding window (per layer) also hides keys at or before p - window from the query at position
p, and the keys before the first query's window are not read at all. Soft-capping (Gemma 2:
tanh(s / cap) * cap on the scaled scores) is not something SDPA does: those layers take the
plain math path (`_attend_math`).

A quantized pool (`--kv-cache-dtype int8|fp8`, kernels/kv_quant.py) is written quantized and read
dequantized: gathers widen the blocks they read, and a chunk's own K/V is taken as the pool holds
it (quantized and back), so every path attends over the values the pool stores.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.kernels import kv_quant
from pdserve.kernels.metadata import AttentionMetadata

# Upper bound on the K+V bytes gathered at once for decode (cache-friendly; measured best at ~4 MB).
DECODE_CHUNK_BYTES = 4 << 20


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value [T, Hkv, D] into kv_layer [2, N, bs, Hkv, D] at `slot_mapping` [T] (-1 = skip);
    a quantized pool [2, N, bs, Hkv, D + 4] (int8, or uint8 for fp8) gets the rows quantized."""
    if slot_mapping.numel() == 0:
        return
    fmt = kv_quant.format_of(kv_layer)
    if fmt is not None and key.dtype != kv_layer.dtype:
        key, value = kv_quant.quantize(key, fmt), kv_quant.quantize(value, fmt)  # [T, Hkv, D + 4]
    _, n, bs, h, d = kv_layer.shape
    flat = kv_layer.view(2, n * bs, h, d)  # [2, N*bs, Hkv, D]
    valid = slot_mapping >= 0  # [T]
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def gather_kv(kv_layer: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """kv_layer [2, N, bs, Hkv, D], block_ids [n, nb] -> [2, n, nb*bs, Hkv, D] in token order (a
    quantized pool's rows [.., D + 4] dequantized to `dtype`)."""
    _, num_blocks, bs, h, d = kv_layer.shape
    n, nb = block_ids.shape
    ids = block_ids.reshape(-1).long()  # [n*nb]
    if kv_layer.is_contiguous():
        g = kv_layer.view(2, num_blocks, bs * h * d).index_select(1, ids)  # [2, n*nb, bs*Hkv*D]
    else:
        g = kv_layer[:, ids]  # [2, n*nb, bs, Hkv, D]
    g = g.view(2, n, nb * bs, h, d)
    return kv_quant.dequantize(g, dtype) if kv_quant.is_quantized(kv_layer) else g  # [2, n, nb*bs, Hkv, D]


def flat_pool(kv_layer: torch.Tensor) -> torch.Tensor | None:
    """kv_layer [2, N, bs, Hkv, D] as [2, N*bs, Hkv, D] token rows (a view), or None when the
    pool's layout does not allow one, or its rows are quantized (then runs are gathered like any other blocks)."""
    if kv_quant.is_quantized(kv_layer) or kv_layer.stride(1) != kv_layer.shape[2] * kv_layer.stride(2):
        return None
    return kv_layer.flatten(1, 2)


def _attend_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor, softcap: float | None
) -> torch.Tensor:
    """Attention written out, for what SDPA lacks (soft-capping): q [..., Hkv, G, q, D] and k/v
    [..., Hkv, 1, S, D] (GQA by broadcast), mask broadcastable to the scores [..., Hkv, G, q, S]."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., Hkv, G, q, S]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)  # [..., Hkv, G, q, D]


def _decode(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """query [nd, Hq, D] (one token per decode sequence) -> out [nd, Hq, D].

    Always gathered, even for sequences whose blocks form a run: one SDPA per sequence on a view
    of the pool was measured slower in the engine (the per-call overhead of ~256 calls a step
    outweighs the saved copy: 75 vs 64 ms a step at batch 32, equal at batch 1-4)."""
    nd, hq, d = query.shape
    _, _, bs, hkv, _ = kv_layer.shape
    groups = hq // hkv
    ctx = meta.context_lens_cpu[:nd]
    max_blocks = -(-max(ctx) // bs)
    seq_bytes = 2 * max_blocks * bs * hkv * d * kv_layer.element_size()
    step = max(1, DECODE_CHUNK_BYTES // seq_bytes)
    for i in range(0, nd, step):
        j = min(nd, i + step)
        c = ctx[i:j]
        # a window: each sequence's gather starts at the block of its first visible key
        first = [max(0, x - window) // bs if window else 0 for x in c]  # block index per sequence
        nb = max(-(-x // bs) - f for x, f in zip(c, first))  # blocks gathered per sequence
        s = nb * bs  # S: gathered tokens per sequence
        tables = meta.block_tables[i:j]  # [n, W]
        if any(first):
            cols = torch.tensor(first, device=query.device)[:, None] + torch.arange(nb, device=query.device)  # [n, nb]
            tables = tables.gather(1, cols.clamp(max=tables.shape[1] - 1))  # past a table's end: masked below
        kv = gather_kv(kv_layer, tables[:, :nb], query.dtype)  # [2, n, S, Hkv, D]
        k = kv[0].transpose(1, 2)  # [n, Hkv, S, D]
        v = kv[1].transpose(1, 2)  # [n, Hkv, S, D]
        q = query[i:j].view(j - i, hkv, groups, d)  # [n, Hkv, G, D]: G heads = G queries
        mask = None
        if window or softcap is not None or any(x != s for x in c):
            start = torch.tensor(first, device=query.device)[:, None] * bs  # [n, 1]
            pos = start + torch.arange(s, device=query.device)  # [n, S]: absolute key positions
            lens = meta.context_lens[i:j, None]  # [n, 1]
            seen = pos < lens
            if window:
                seen &= pos >= lens - window  # the query (position len - 1) sees keys > len - 1 - window
            mask = seen[:, None, None, :]  # [n, 1, 1, S]
        if softcap is not None:
            assert mask is not None
            o = _attend_math(q[:, :, :, None], k[:, :, None], v[:, :, None], scale, mask[..., None, :], softcap)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # [n, Hkv, G, D]
        out[i:j] = o.reshape(j - i, hq, d)


def _sdpa4d(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, gqa: bool, **kw) -> torch.Tensor:
    """SDPA on [H, L, D] inputs given a batch axis: on CPU only 4-D inputs reach the flash kernel;
    3-D ones fall back to the math path (materialised [Hq, q, kv] scores), 3-4x slower for a
    640-token prompt."""
    return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=scale, enable_gqa=gqa, **kw)[0]


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """query [T, Hq, D]; key/value [T, Hkv, D] (this step's, already stored) -> out [T, Hq, D]."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [T, Hq, D]
    attend_decodes(query, kv_layer, meta, scale, out)
    attend_prefills(query, key, value, kv_layer, meta, scale, out)
    return out


def attend_decodes(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """The decode sequences (the first num_decode_seqs) of paged_attention, into out [T, Hq, D]."""
    nd = meta.num_decode_seqs
    if nd:
        _decode(query[:nd], kv_layer, meta, scale, out[:nd], window, softcap)


def attend_prefills(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """The prefill chunks (sequences after the decodes) of paged_attention, into out [T, Hq, D]."""
    nd = meta.num_decode_seqs
    if nd == len(meta.context_lens_cpu):
        return
    fmt = kv_quant.format_of(kv_layer)
    if fmt is not None:  # this step's K/V as the pool holds them
        key, value = kv_quant.roundtrip(key, fmt), kv_quant.roundtrip(value, fmt)  # [T, Hkv, D]
    cu, ctx = meta.cu_seqlens_q_cpu, meta.context_lens_cpu
    bs = kv_layer.shape[2]
    gqa = query.shape[1] != kv_layer.shape[3]
    for b in range(nd, len(ctx)):
        s, e, c = cu[b], cu[b + 1], ctx[b]
        q_len = e - s
        q = query[s:e].transpose(0, 1)  # [Hq, q, D]
        if window or softcap is not None:
            out[s:e] = _prefill_windowed(q, key[s:e], value[s:e], kv_layer, meta, b, scale, window, softcap)
            continue
        if c == q_len:  # whole prompt in this chunk: its own K/V, plain causal, no gather
            k = key[s:e].transpose(0, 1)  # [Hkv, q, D]
            v = value[s:e].transpose(0, 1)  # [Hkv, q, D]
            o = _sdpa4d(q, k, v, scale, gqa, is_causal=True)
        else:
            run = meta.kv_run_start_cpu[b] if meta.kv_run_start_cpu is not None else -1
            flat = flat_pool(kv_layer) if run >= 0 else None
            if flat is not None:  # one run of blocks: read in place
                k = flat[0, run * bs : run * bs + c].transpose(0, 1)  # [Hkv, c, D]
                v = flat[1, run * bs : run * bs + c].transpose(0, 1)  # [Hkv, c, D]
            else:
                kv = gather_kv(
                    kv_layer, meta.block_tables[b : b + 1, : -(-c // bs)], query.dtype
                )  # [2, 1, nb*bs, Hkv, D]
                k = kv[0, 0, :c].transpose(0, 1)  # [Hkv, c, D]
                v = kv[1, 0, :c].transpose(0, 1)  # [Hkv, c, D]
            i = torch.arange(q_len, device=query.device)[:, None]  # [q, 1]
            j = torch.arange(c, device=query.device)[None, :]  # [1, c]
            mask = j <= i + (c - q_len)  # [q, c] bottom-right causal
            o = _sdpa4d(q, k, v, scale, gqa, attn_mask=mask)
        out[s:e] = o.transpose(0, 1)  # [q, Hq, D]


def _prefill_windowed(
    q: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    b: int,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Sequence b's chunk q [Hq, q, D] (its key/value [q, Hkv, D] this step's) with a sliding window
    and/or soft-capping -> [q, Hq, D]. Only keys from the first query's window on are read:

        context c = 6, q_len = 2, window 3: query at position p sees keys p-2 .. p
        j: 0 1 2 3 4 5
    p=4    . . x x x .      keys read: lo = c - q_len - window + 1 = 2 .. c - 1
    p=5    . . . x x x
    """
    c, q_len, bs = meta.context_lens_cpu[b], q.shape[1], kv_layer.shape[2]
    lo = max(0, c - q_len - window + 1) if window else 0  # the first key any query here sees
    if lo >= c - q_len:  # every key read is this step's: no gather
        k, v = key[lo - (c - q_len) :], value[lo - (c - q_len) :]  # [c - lo, Hkv, D]
    else:
        first = lo // bs
        kv = gather_kv(kv_layer, meta.block_tables[b : b + 1, first : -(-c // bs)], q.dtype)  # [2, 1, nb*bs, Hkv, D]
        k, v = kv[0, 0, lo - first * bs : c - first * bs], kv[1, 0, lo - first * bs : c - first * bs]
    pos = torch.arange(c - q_len, c, device=q.device)[:, None]  # [q, 1] query positions
    j = torch.arange(lo, c, device=q.device)[None, :]  # [1, c - lo] key positions
    mask = j <= pos  # [q, c - lo]
    if window:
        mask &= j > pos - window
    hq, hkv = q.shape[0], k.shape[1]
    k, v = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, c - lo, D]
    if softcap is None:
        o = _sdpa4d(q, k, v, scale, hq != hkv, attn_mask=mask)  # [Hq, q, D]
    else:
        g = hq // hkv
        o = _attend_math(q.view(hkv, g, q_len, -1), k[:, None], v[:, None], scale, mask, softcap)
        o = o.reshape(hq, q_len, -1)  # [Hq, q, D]
    return o.transpose(0, 1)  # [q, Hq, D]
