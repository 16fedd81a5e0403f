"""Turn a scheduler step into flat ragged tensors (no padding) for one forward pass."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.scheduler import ScheduledChunk
from pdserve.engine.sequence import Sequence
from pdserve.kernels import AttentionMetadata
from pdserve.kernels.metadata import run_start


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [R] rows of T whose logits are computed (R >= S)
    sampled: list[ScheduledChunk]  # the S chunks that complete their sequence, in row order
    # per sampled chunk: its first row in the logits, and its drafts (engine/spec/): a chunk with
    # d drafts has d + 1 logits rows (its last token's and each draft's), others one
    logits_offsets: list[int]
    num_drafts: list[int]
    # prompt logprobs (engine/prompt_logprobs.py): rows of T scored after the S sampled ones, each
    # row's next prompt token, and per chunk that asks (sequence, first position scored, rows)
    prompt_rows: torch.Tensor | None = None  # [P] int64
    prompt_targets: torch.Tensor | None = None  # [P] int64
    prompt_spans: list[tuple[Sequence, int, int]] = field(default_factory=list)

    @property
    def head_rows(self) -> torch.Tensor:
        """The rows of T the LM head computes: the sampled ones [S], then the prompt's [P]."""
        if self.prompt_rows is None:
            return self.logits_indices
        return torch.cat([self.logits_indices, self.prompt_rows])


def build_batch(chunks: list[ScheduledChunk], num_decodes: int, block_size: int, device: torch.device) -> ForwardBatch:
    """`chunks` = decodes (first `num_decodes`, one token each) then prefill chunks."""
    input_ids: list[int] = []
    positions: list[int] = []
    cu_seqlens = [0]
    context_lens: list[int] = []
    logits_rows: list[int] = []
    sampled: list[ScheduledChunk] = []
    logits_offsets: list[int] = []
    num_drafts: list[int] = []
    prompt_rows: list[int] = []
    prompt_targets: list[int] = []
    prompt_spans: list[tuple[Sequence, int, int]] = []
    for chunk in chunks:
        seq, start = chunk.seq, chunk.seq.num_computed_tokens
        end = start + chunk.num_tokens
        scored = min(end, seq.num_prompt_tokens - 1) - start  # positions scoring a prompt token
        if seq.prompt_scores is not None and scored > 0:
            prompt_rows.extend(range(cu_seqlens[-1], cu_seqlens[-1] + scored))
            prompt_targets.extend(seq.token_ids[start + 1 : start + 1 + scored])
            prompt_spans.append((seq, start, scored))
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        cu_seqlens.append(cu_seqlens[-1] + chunk.num_tokens)
        context_lens.append(end)
        if chunk.completes_sequence:
            drafts = min(seq.num_draft_tokens, chunk.num_tokens - 1)
            logits_offsets.append(len(logits_rows))
            num_drafts.append(drafts)
            logits_rows.extend(range(cu_seqlens[-1] - 1 - drafts, cu_seqlens[-1]))
            sampled.append(chunk)

    max_blocks = max(len(c.seq.block_table) for c in chunks)
    tables = [c.seq.block_table + [0] * (max_blocks - len(c.seq.block_table)) for c in chunks]
    block_tables = torch.tensor(tables, dtype=torch.int32)  # [B, max_blocks]
    pos = torch.tensor(positions, dtype=torch.int64)  # [T]
    q_lens = torch.tensor([c.num_tokens for c in chunks], dtype=torch.int64)  # [B]
    seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), q_lens)  # [T]
    block_of_token = block_tables[seq_of_token, pos // block_size].to(torch.int64)  # [T]
    slot_mapping = block_of_token * block_size + pos % block_size  # [T]

    attn = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        num_decode_seqs=num_decodes,
        max_q_len=max(c.num_tokens for c in chunks),
        max_context_len=max(context_lens),
        cu_seqlens_q_cpu=cu_seqlens,
        context_lens_cpu=context_lens,
        kv_run_start_cpu=[run_start(c.seq.block_table) for c in chunks],
    )
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=pos.to(device),
        slot_mapping=slot_mapping.to(device),
        attn=attn,
        logits_indices=torch.tensor(logits_rows, dtype=torch.int64, device=device),
        sampled=sampled,
        logits_offsets=logits_offsets,
        num_drafts=num_drafts,
        prompt_rows=torch.tensor(prompt_rows, dtype=torch.int64, device=device) if prompt_spans else None,
        prompt_targets=torch.tensor(prompt_targets, dtype=torch.int64, device=device) if prompt_spans else None,
        prompt_spans=prompt_spans,
    )
