"""What every rank needs for one forward step, sent by rank 0 as two broadcasts: a fixed header
of sizes, then one flat int64 tensor holding the rest.

    header  [HEADER] int64: T, B, W (block table width), S, C, num_decodes, max_q_len,
                            max_context_len, has_run_start, K
    payload [3T + (B+1) + B + B*W + S + 2C + B] int64:
            input_ids | positions | slot_mapping | cu_seqlens_q | context_lens | block_tables |
            logits_indices | copy sources | copy destinations | kv_run_start
    plan    [K] uint8, only when K > 0: a prefill worker's per-rank KV sends of the step
            (kvtransfer/rank_sends.py `RankPlan`, msgpack)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.batch import ForwardBatch
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.kernels import AttentionMetadata

HEADER = 10


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [S] int64
    copy_src: torch.Tensor  # [C] int64: blocks copied to copy_dst before the step (copy-on-write)
    copy_dst: torch.Tensor  # [C] int64
    kv_plan: bytes = b""  # the ranks' KV sends of this step (prefill worker), else empty


def send_step(
    group: TensorParallelGroup, batch: ForwardBatch, copies: list[tuple[int, int]], kv_plan: bytes = b""
) -> None:
    """Rank 0: broadcast the step's batch, block copies and the ranks' KV sends."""
    a = batch.attn
    run_start = a.kv_run_start_cpu
    header = [
        batch.input_ids.numel(),
        a.num_seqs,
        a.block_tables.shape[1],
        batch.head_rows.numel(),
        len(copies),
        a.num_decode_seqs,
        a.max_q_len,
        a.max_context_len,
        int(run_start is not None),
        len(kv_plan),
    ]
    src, dst = [s for s, _ in copies], [d for _, d in copies]
    payload = torch.cat(
        [
            batch.input_ids,
            batch.positions,
            batch.slot_mapping,
            a.cu_seqlens_q.to(torch.int64),
            a.context_lens.to(torch.int64),
            a.block_tables.to(torch.int64).flatten(),
            batch.head_rows,  # (the sampled rows, then any prompt rows scored: ranks run the same head)
            torch.tensor(src + dst + (run_start or []), dtype=torch.int64),
        ]
    )  # [P]
    group.broadcast(torch.tensor(header, dtype=torch.int64))
    group.broadcast(payload)
    if kv_plan:
        group.broadcast(torch.frombuffer(bytearray(kv_plan), dtype=torch.uint8))


def receive_step(group: TensorParallelGroup) -> StepInputs:
    """Ranks > 0: the step rank 0 sends (`send_step`)."""
    header = group.broadcast(torch.empty(HEADER, dtype=torch.int64)).tolist()
    t, b, w, s, c, num_decodes, max_q, max_ctx, has_run_start, k = header
    sizes = [t, t, t, b + 1, b, b * w, s, c, c, b if has_run_start else 0]
    payload = group.broadcast(torch.empty(sum(sizes), dtype=torch.int64))  # [P]
    ids, pos, slots, cu, ctx, tables, logits_rows, src, dst, run_start = payload.split(sizes)
    kv_plan = group.broadcast(torch.empty(k, dtype=torch.uint8)).numpy().tobytes() if k else b""
    cu_cpu, ctx_cpu = cu.tolist(), ctx.tolist()
    attn = AttentionMetadata(
        cu_seqlens_q=cu.to(torch.int32),
        context_lens=ctx.to(torch.int32),
        block_tables=tables.to(torch.int32).view(b, w),
        num_decode_seqs=num_decodes,
        max_q_len=max_q,
        max_context_len=max_ctx,
        cu_seqlens_q_cpu=cu_cpu,
        context_lens_cpu=ctx_cpu,
        kv_run_start_cpu=run_start.tolist() if has_run_start else None,
    )
    return StepInputs(ids, pos, slots, attn, logits_rows, src, dst, kv_plan)
