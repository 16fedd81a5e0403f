"""Pure-torch paged attention and KV store: the CPU path and the reference for Triton.

Decode sequences (one query each) are computed together in one batched call; prefill chunks one
sequence at a time (compute-bound: the loop costs nothing next to the matmuls). A prefill chunk
with no earlier context uses its own fresh K/V; one with earlier context gathers its KV from the
paged pool and needs a bottom-right-aligned causal mask:

    context c = 5, q_len = 3:  query i may see KV j <= c - q_len + i
        j: 0 1 2 3 4
    i=0    x x x . .
    i=1    x x x x .
    i=2    x x x x x
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def store_kv(key: torch.Tensor, value: torch.Tensor, kv_layer: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] -> kv_layer [2, N, bs, Hkv, D] at slots; slot -1 = skip."""
    _, n, bs, h, d = kv_layer.shape
    flat = kv_layer.view(2, n * bs, h, d)  # [2, N*bs, Hkv, D]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def _gather(kv: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """kv [N, bs, Hkv, D], blocks [nb] -> [length, Hkv, D] in token order."""
    return kv[blocks].flatten(0, 1)[:length]


def _decode(query: torch.Tensor, kv_layer: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, max_ctx: int, scale: float) -> torch.Tensor:
    nd, hq, d = query.shape
    bs = kv_layer.shape[2]
    nb = -(-max_ctx // bs)
    blocks = block_tables[:, :nb].long()  # [nd, nb]
    k = kv_layer[0][blocks].flatten(1, 2)  # [nd, S, Hkv, D], S = nb*bs
    v = kv_layer[1][blocks].flatten(1, 2)  # [nd, S, Hkv, D]
    s = k.shape[1]
    mask = torch.arange(s, device=query.device)[None, :] < context_lens[:, None]  # [nd, S]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [nd, Hq, 1, D]
        k.transpose(1, 2), v.transpose(1, 2),  # [nd, Hkv, S, D]
        attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)  # [nd, Hq, 1, D]
    return out.squeeze(2)


def paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """query [T, Hq, D]; key/value [T, Hkv, D] (this step's, already stored) -> [T, Hq, D]."""
    out = torch.empty_like(query)
    nd = meta.num_decode_seqs
    cu, ctx = meta.cu_seqlens_q_cpu, meta.context_lens_cpu
    if nd:
        out[:nd] = _decode(query[:nd], kv_layer, meta.block_tables[:nd], meta.context_lens[:nd],
                           max(ctx[:nd]), scale)
    bs = kv_layer.shape[2]
    for b in range(nd, len(ctx)):
        s, e, c = cu[b], cu[b + 1], ctx[b]
        q_len = e - s
        q = query[s:e].transpose(0, 1)  # [Hq, q, D]
        if c == q_len:  # whole prompt in this chunk: no gather, plain causal
            k, v = key[s:e], value[s:e]  # [q, Hkv, D]
            o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1),
                                               is_causal=True, scale=scale, enable_gqa=True)
        else:
            blocks = meta.block_tables[b, : -(-c // bs)].long()
            k = _gather(kv_layer[0], blocks, c)  # [c, Hkv, D]
            v = _gather(kv_layer[1], blocks, c)
            i = torch.arange(q_len, device=query.device)[:, None]
            j = torch.arange(c, device=query.device)[None, :]
            mask = j <= (c - q_len) + i  # [q, c] bottom-right causal
            o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1),
                                               attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:e] = o.transpose(0, 1)  # [q, Hq, D]
    return out
