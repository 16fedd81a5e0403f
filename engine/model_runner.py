"""Owns the model and its KV pool; runs one scheduled step and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.engine.batch import ForwardBatch, build_batch
from pdserve.engine.config import ModelConfig
from pdserve.engine.cuda_graphs import DecodeGraphs
from pdserve.engine.gguf_file import is_gguf, release_gguf
from pdserve.engine.models.gemma import GemmaForCausalLM
from pdserve.engine.models.interface import CausalLM, LayerInputs
from pdserve.engine.models.llama import ForwardContext, LlamaForCausalLM
from pdserve.engine.models.quantized_linear import (
    keep_gguf_blocks,
    prompt_rows_from,
    quantize_model,
    use_bf16_prompts,
    use_int8_activations,
)
from pdserve.engine.parallel.group import TensorParallelGroup
from pdserve.engine.prompt_logprobs import ChunkScores, score_rows
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.weights import load_weights
from pdserve.kvtransfer.head_ranges import HeadShard

log = logging.getLogger(__name__)


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    max_positions: int,
    show_progress: bool = True,
    quantization: str = "auto",
    tp: TensorParallelGroup | None = None,
    activations: str = "none",
    prompt_linears: str = "int8",
) -> CausalLM:
    """`tp`: this process's rank of a tensor-parallel group; it loads that rank's shard only.
    `activations` int8: the quantized linears quantize their inputs (few-row calls); `prompt_linears`
    bf16 (resolved): the layers' linears on a file's blocks multiply prompts' rows in bf16."""
    if cfg.impl == "transformers":  # any other decoder-only model (models/transformers_backend.py)
        from pdserve.engine.models.transformers_backend import load_transformers_model

        if quantization not in ("none", "auto"):
            raise ValueError("--quantization is served on the native model path only, not through transformers")
        return load_transformers_model(cfg, dtype, device)
    with torch.device("meta"):
        model = (GemmaForCausalLM if cfg.family == "gemma" else LlamaForCausalLM)(cfg, max_positions, tp)
    if quantization != "none" and is_gguf(cfg.path) and device.type == "cpu":
        keep_gguf_blocks(model, quantization, cfg.path, as_stored=activations == "int8")  # never dequantized
    model.materialize(device, dtype)
    load_weights(model, cfg.path, show_progress=show_progress)
    if is_gguf(cfg.path):  # drop the reader: the map stays only under blocks served as stored (views of it)
        release_gguf()
    model.loaded()
    if quantization in ("int8", "int4"):
        quantize_model(model, quantization)  # the linears still float; before the relayout, which skips them
    if activations == "int8":
        log.info("int8 activations on %d quantized linears", use_int8_activations(model))
    if prompt_linears == "bf16":
        log.info("prompts' rows in bf16 on %d linears of the file's blocks", use_bf16_prompts(model))
    if device.type == "cpu":
        kind = model.use_cpu_weight_layout()
        from pdserve.kernels import (
            cpu_native,  # built now (about a second, once per machine), not at the first decode step
        )

        log.info(
            "CPU linear weights: %s; decode attention: %s",
            kind,
            "C kernel" if cpu_native.available() else "torch (no C kernel)",
        )
    return model.eval()


@dataclass
class ForwardPass:
    """One step's forward pass, run in stages: `begin`, `run_layers`, `logits`.
    Each stage may run on a different thread (prefill lanes); only one at a time."""

    batch: ForwardBatch
    ctx: ForwardContext
    x: torch.Tensor  # [T, H] hidden states after `next_layer` layers
    rope: LayerInputs  # what every layer takes besides x (native: the rotary tables)
    next_layer: int = 0
    # (sequence, its tokens with KV once this pass is done): the engine publishes full blocks then
    computed_upto: list[tuple[Sequence, int]] = field(default_factory=list)
    # tensor parallelism: `on_layer_stored` runs once a whole layer is done (every rank's KV stored)
    after_layer: Callable[[int], None] | None = None
    graphed: bool = False  # a decode step replayed from a CUDA graph: `x` is set by run_layers
    graph_logits: torch.Tensor | None = None  # [S, V] the replay's logits
    # the prompt logprobs its chunks asked for, computed by `ModelRunner.logits` (engine/prompt_logprobs.py)
    prompt_scores: list[tuple[Sequence, ChunkScores]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        sampler: Sampler,
        decode_graphs: DecodeGraphs | None = None,
    ) -> None:
        """`decode_graphs`: CUDA graphs for pure decode steps (engine/cuda_graphs.py); None: eager."""
        self.model = model
        self.kv_cache = kv_cache  # [L, 2, N, bs, Hkv, D]
        self.block_size = block_size
        self.sampler = sampler
        self.device = kv_cache.device
        self.num_layers = len(model.layers)
        self.decode_layers = model.describe_decode_layers(kv_cache)  # None: small decode steps go layer by layer
        self.decode_graphs = decode_graphs
        # called as each layer of a pass run layer by layer finishes (a worker: heartbeats report
        # a long step's progress, runtime/worker_runtime.py), from the thread running it
        self.on_layer_done: Callable[[], None] | None = None

    @torch.inference_mode()
    def begin(self, sched: SchedulerOutput, on_layer_stored: Callable[[int], None] | None = None) -> ForwardPass:
        """Build the step's batch (from the chunks' current `num_computed_tokens`) and embed it.
        Shared blocks a sequence is about to write get their copies first (copy-on-write)."""
        if sched.block_copies:
            src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*sched.block_copies))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # [L, 2, C, bs, Hkv, D]
        batch = build_batch(sched.chunks, len(sched.decodes), self.block_size, self.device)
        ctx = ForwardContext(batch.attn, batch.slot_mapping, self.kv_cache, on_layer_stored)
        if self._graphable(batch, on_layer_stored):
            return ForwardPass(batch, ctx, batch.input_ids, None, graphed=True)  # x: set by the replay
        x, rope = self.model.embed(batch.input_ids, batch.positions)
        return ForwardPass(batch, ctx, x, rope)

    def _graphable(self, batch: ForwardBatch, on_layer_stored: Callable[[int], None] | None) -> bool:
        """Whether this step replays a CUDA graph: only one-token decodes (no drafts), nobody
        streaming its layers, a batch within the largest bucket."""
        graphs, attn = self.decode_graphs, batch.attn
        return (
            graphs is not None
            and on_layer_stored is None
            and attn.num_decode_seqs == attn.num_seqs == batch.input_ids.shape[0] == len(batch.sampled)
            and graphs.bucket(attn.num_seqs) is not None
        )

    @torch.inference_mode()
    def run_layers(self, fp: ForwardPass, count: int | None = None) -> None:
        """The pass's next `count` layers (default: all that are left)."""
        stop = self.num_layers if count is None else min(self.num_layers, fp.next_layer + count)
        if fp.graphed:  # every layer in one replay, whatever `count` asked
            if fp.next_layer == 0:
                assert self.decode_graphs is not None
                fp.x, fp.graph_logits = self.decode_graphs.run(fp.batch)  # [B, H], [B, V]
                fp.next_layer = self.num_layers
            return
        if self.decode_layers is not None and fp.next_layer == 0 and stop == self.num_layers:
            fused = self.model.fused_decode(
                self.decode_layers, fp.x, fp.rope, fp.ctx
            )  # a small decode step: one C call
            if fused is not None:
                fp.x, fp.next_layer = fused, stop
                return
        attn = fp.batch.attn
        with prompt_rows_from(attn.cu_seqlens_q_cpu[attn.num_decode_seqs], fp.x.shape[0]):  # decodes' rows first
            while fp.next_layer < stop:
                fp.x = self.model.layers[fp.next_layer](fp.x, fp.rope, fp.ctx)
                fp.next_layer += 1
                if self.on_layer_done is not None:
                    self.on_layer_done()

    def close(self) -> None:
        """Release what the runner started (a tensor-parallel runner: its rank processes)."""

    @property
    def kv_head_shards(self) -> list[HeadShard]:
        """Every KV pool of this engine with the heads it holds: one here; one per rank under
        tensor parallelism (rank 0 maps them all), what KV transfers read and write."""
        return [HeadShard(0, self.kv_cache.shape[4], self.kv_cache)]

    @torch.inference_mode()
    def logits(self, fp: ForwardPass) -> torch.Tensor | None:
        """[R, V] for the chunks that complete their sequence (a row each, a speculating one's
        d + 1); None when none does. The same head pass scores the prompt positions its chunks
        ask for (`fp.prompt_scores`)."""
        if fp.graph_logits is not None:
            return fp.graph_logits  # every row is a decode's, in the batch's order
        batch = fp.batch
        if not batch.sampled and not batch.prompt_spans:
            return None
        logits = self.model.head(fp.x, batch.head_rows)  # [R + P, V]
        num_sampled = batch.logits_indices.numel()  # R: a sampled chunk's rows (one, or drafts + 1)
        if batch.prompt_spans:
            assert batch.prompt_targets is not None
            k = max(seq.sampling.prompt_logprobs or 0 for seq, _, _ in batch.prompt_spans)
            lps, ranks, ids, tops = score_rows(logits[num_sampled:], batch.prompt_targets, k)
            at = 0
            for seq, first, n in batch.prompt_spans:
                chunk = ChunkScores(first, lps[at : at + n], ranks[at : at + n], ids[at : at + n], tops[at : at + n])
                fp.prompt_scores.append((seq, chunk))
                at += n
        return logits[:num_sampled] if num_sampled else None
