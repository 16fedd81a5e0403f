"""Owns the model and its KV pool; runs one scheduled step and samples."""
from __future__ import annotations

import logging
from typing import Callable

import torch

from engine.batch import build_batch
from engine.config import ModelConfig
from engine.models.llama import ForwardContext, LlamaForCausalLM
from engine.sampler import Sampler, SamplerOutput
from engine.scheduler import ScheduledChunk, SchedulerOutput
from engine.weights import load_weights

log = logging.getLogger(__name__)


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
               show_progress: bool = True) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    model.materialize(device, dtype)
    load_weights(model, cfg.path, show_progress=show_progress)
    if device.type == "cpu":
        kind = model.use_cpu_weight_layout()
        from kernels import cpu_native  # built now (about a second, once per machine), not at the first decode step
        log.info("CPU linear weights: %s; decode attention: %s", kind,
                 "C kernel" if cpu_native.available() else "torch (no C kernel)")
    return model.eval()


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: torch.Tensor, block_size: int,
                 sampler: Sampler) -> None:
        self.model = model
        self.kv_cache = kv_cache  # [L, 2, N, bs, Hkv, D]
        self.block_size = block_size
        self.sampler = sampler
        self.device = kv_cache.device

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput,
                on_layer_stored: Callable[[int], None] | None = None
                ) -> tuple[list[ScheduledChunk], SamplerOutput | None]:
        """Run one forward pass; returns the chunks that sampled and what they sampled."""
        batch = build_batch(sched.chunks, len(sched.decodes), self.block_size, self.device)
        ctx = ForwardContext(batch.attn, batch.slot_mapping, self.kv_cache, on_layer_stored)
        logits = self.model(batch.input_ids, batch.positions, ctx, batch.logits_indices)  # [S, V]
        if not batch.sampled:
            return [], None
        seqs = [c.seq for c in batch.sampled]
        out = self.sampler(logits, [s.sampling for s in seqs],
                           [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs])
        return batch.sampled, out
