"""CUDA graphs of the decode step: the whole forward pass (embedding, every layer, LM head) of a
step whose sequences each decode one token, captured once per (batch bucket, context bucket)
and replayed. A decode step of a small batch is bound by kernel launches and Python (about 15
launches a layer); a replay is one launch.

    step of B decodes, longest context C
      B -> batch bucket Bp >= B (1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to max_num_seqs)
      C -> context bucket Cp >= C (powers of two from 1024 up to max_model_len)
      (Bp, Cp) captured on first use; replayed with this step's inputs copied in:
        rows [0, B)  the step's tokens, positions, slots, block tables, context lengths
        rows [B, Bp) padding: slot -1 (stores nothing), context 1 (reads block 0, result unused)

The context bucket fixes the Triton decode kernel's KV split plan (kernels/triton_attention.py
plans splits from the longest context it is told of; splits past a sequence's end are empty), so
a replay of (Bp, Cp) is exact for any context up to Cp. Graphs share one memory pool and are
replayed one at a time on the runner's thread, each reading its own static inputs.

Used by engine/model_runner.py for CUDA steps that are pure decodes on the Triton attention path,
without tensor parallelism or drafts; everything else runs eagerly (and `--enforce-eager` turns
graphs off)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.engine.batch import ForwardBatch
from pdserve.engine.models.interface import CausalLM
from pdserve.engine.models.llama import ForwardContext
from pdserve.kernels import AttentionMetadata

log = logging.getLogger(__name__)

MIN_CONTEXT_BUCKET = 1024


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 32, of 16 to 64, of 32 beyond, ending at `max_batch`."""
    out: list[int] = []
    b = 1
    while b < max_batch:
        out.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 32 else 16 if b < 64 else 32)
    out.append(max_batch)
    return out


def context_bucket(context: int, max_model_len: int) -> int:
    """The smallest power of two >= `context` (at least MIN_CONTEXT_BUCKET), capped at max_model_len."""
    c = MIN_CONTEXT_BUCKET
    while c < context:
        c *= 2
    return min(c, max_model_len)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [Bp, H] the last layer's output (an EAGLE head reads it)
    logits: torch.Tensor  # [Bp, V] fp32


class DecodeGraphs:
    """Captured decode steps of one model over one KV pool [L, 2, N, bs, Hkv, D]."""

    def __init__(self, model: CausalLM, kv_cache: torch.Tensor, max_batch: int, max_model_len: int) -> None:
        if kv_cache.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA KV pool")
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.block_size = kv_cache.shape[3]
        self.max_model_len = max_model_len
        self.buckets = batch_buckets(max_batch)
        bp, width = self.buckets[-1], -(-max_model_len // self.block_size)
        dev = self.device
        # static inputs, [max bucket] rows; a graph of Bp rows reads the first Bp
        self.input_ids = torch.zeros(bp, dtype=torch.int64, device=dev)  # [Bp]
        self.positions = torch.zeros(bp, dtype=torch.int64, device=dev)  # [Bp]
        self.slot_mapping = torch.full((bp,), -1, dtype=torch.int64, device=dev)  # [Bp]
        self.context_lens = torch.ones(bp, dtype=torch.int32, device=dev)  # [Bp]
        self.block_tables = torch.zeros((bp, width), dtype=torch.int32, device=dev)  # [Bp, W]
        self.cu_seqlens = torch.arange(bp + 1, dtype=torch.int32, device=dev)  # [Bp + 1]: one token each
        self.rows = torch.arange(bp, dtype=torch.int64, device=dev)  # [Bp] logits rows
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.capture_seconds = 0.0

    def bucket(self, batch: int) -> int | None:
        """The batch bucket a step of `batch` decodes replays in; None when it is too large."""
        return next((b for b in self.buckets if b >= batch), None)

    def _meta(self, bp: int, cp: int) -> AttentionMetadata:
        """Metadata over the static inputs; the CPU lists only plan the kernels (as if every
        sequence were `cp` long): the device tensors bound what each sequence reads."""
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens[: bp + 1],
            context_lens=self.context_lens[:bp],
            block_tables=self.block_tables[:bp],
            num_decode_seqs=bp,
            max_q_len=1,
            max_context_len=cp,
            cu_seqlens_q_cpu=list(range(bp + 1)),
            context_lens_cpu=[cp] * bp,
        )

    def _forward(self, bp: int, cp: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = ForwardContext(self._meta(bp, cp), self.slot_mapping[:bp], self.kv_cache)
        x, rope = self.model.embed(self.input_ids[:bp], self.positions[:bp])
        for layer in self.model.layers:
            x = layer(x, rope, ctx)
        return x, self.model.head(x, self.rows[:bp])  # [Bp, H], [Bp, V]

    def _capture(self, bp: int, cp: int) -> _Graph:
        started = time.perf_counter()
        self.slot_mapping[:bp].fill_(-1)  # the warm-up and capture runs store nothing
        self.context_lens[:bp].fill_(1)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # compile every kernel outside the capture
            self._forward(bp, cp)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            hidden, logits = self._forward(bp, cp)
        self.capture_seconds += time.perf_counter() - started
        log.info("captured a decode CUDA graph: batch %d, context <= %d (%.2fs)", bp, cp, time.perf_counter() - started)
        return _Graph(graph, hidden, logits)

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """A step of B one-token decodes (`batch`, built by engine/batch.py): hidden [B, H] and
        logits [B, V], views of the graph's outputs (valid until the next replay)."""
        b = batch.input_ids.shape[0]
        bp = self.bucket(b)
        assert bp is not None and batch.attn.num_decode_seqs == b
        cp = context_bucket(batch.attn.max_context_len, self.max_model_len)
        entry = self.graphs.get((bp, cp))
        if entry is None:
            entry = self.graphs[(bp, cp)] = self._capture(bp, cp)
        tables = batch.attn.block_tables  # [B, w]
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.slot_mapping[:b].copy_(batch.slot_mapping)
        self.slot_mapping[b:bp].fill_(-1)
        self.context_lens[:b].copy_(batch.attn.context_lens)
        self.context_lens[b:bp].fill_(1)
        self.block_tables[:b, : tables.shape[1]].copy_(tables)
        entry.graph.replay()
        return entry.hidden[:b], entry.logits[:b]
