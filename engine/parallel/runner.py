"""Rank 0 of a tensor-parallel engine: starts the other ranks, and each step broadcasts what
their forward needs before running its own shard of the same layers; it alone samples.

    rank 0 (this process: scheduler, block pool, prefix cache, sampler)
      begin:      ring ranks -> broadcast step (batch + block copies) -> embed (all-reduce)
      run_layers: per layer: attention (all-reduce), MLP (all-reduce)      } same order on
      logits:     LM head slice -> gather on rank 0                       } every rank
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from pdserve.engine.batch import build_batch
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.kv_cache import KVCacheSpec, allocate_kv_cache
from pdserve.engine.model_runner import ForwardPass, ModelRunner, load_model
from pdserve.engine.models.interface import CausalLM
from pdserve.engine.models.llama import ForwardContext
from pdserve.engine.parallel.group import TensorParallelError, TensorParallelGroup, host_store
from pdserve.engine.parallel.rank_config import RankConfig
from pdserve.engine.parallel.ranks import RankProcesses
from pdserve.engine.parallel.shard import TensorParallelShard, check_tensor_parallel
from pdserve.engine.parallel.step_inputs import send_step
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 1800.0  # the ranks loading their shards (rank 0 loads its own meanwhile)


class TensorParallelRunner(ModelRunner):
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        sampler: Sampler,
        group: TensorParallelGroup,
        ranks: RankProcesses,
    ) -> None:
        super().__init__(model, kv_cache, block_size, sampler)
        self.group, self.ranks = group, ranks

    @torch.inference_mode()
    def begin(self, sched: SchedulerOutput, on_layer_stored: Callable[[int], None] | None = None) -> ForwardPass:
        if on_layer_stored is not None:
            raise ValueError("streaming KV layer by layer (a prefill worker) is not built for tensor parallelism yet")
        batch = build_batch(sched.chunks, len(sched.decodes), self.block_size, self.device)
        try:
            self.ranks.ring()
            send_step(self.group, batch, sched.block_copies)
            if sched.block_copies:
                src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*sched.block_copies))
                self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # [L, 2, C, bs, Hkv, D]
            ctx = ForwardContext(batch.attn, batch.slot_mapping, self.kv_cache)
            x, rope = self.model.embed(batch.input_ids, batch.positions)  # [T, H]
        except TensorParallelError as e:
            raise self._failed(e) from e
        return ForwardPass(batch, ctx, x, rope)

    def run_layers(self, fp: ForwardPass, count: int | None = None) -> None:
        try:
            super().run_layers(fp, count)
        except TensorParallelError as e:
            raise self._failed(e) from e

    def logits(self, fp: ForwardPass) -> torch.Tensor | None:
        try:
            return super().logits(fp)
        except TensorParallelError as e:
            raise self._failed(e) from e

    def _failed(self, e: TensorParallelError) -> TensorParallelError:
        time.sleep(0.05)  # a rank that just died: let its exit status show
        return TensorParallelError(f"{e} -- {self.ranks.describe()}; the engine cannot continue")

    def close(self) -> None:
        self.ranks.close()


def start_tensor_parallel(
    config: EngineConfig,
    mc: ModelConfig,
    dtype: torch.dtype,
    kv_spec: KVCacheSpec,
    num_blocks: int,
    max_positions: int,
    sampler: Sampler,
    show_progress: bool,
) -> TensorParallelRunner:
    """Start ranks 1..N-1, load rank 0's shard here, and return rank 0's runner once all are ready.
    Each rank gets this process's torch threads / N (at least one)."""
    n, timeout = config.tensor_parallel_size, config.tensor_parallel_timeout_s
    shard = TensorParallelShard(0, n)
    check_tensor_parallel(mc, n)
    threads = max(1, torch.get_num_threads() // n)
    torch.set_num_threads(threads)
    store = host_store(n, timeout)
    ranks = RankProcesses(
        [
            RankConfig(
                model=mc.path,
                model_impl=config.model_impl,
                dtype=str(dtype).removeprefix("torch."),
                device=config.device,
                max_positions=max_positions,
                block_size=kv_spec.block_size,
                num_blocks=num_blocks,
                rank=rank,
                size=n,
                store_port=store.port,
                timeout_s=timeout,
                threads=threads,
            )
            for rank in range(1, n)
        ]
    )
    try:
        try:
            group = TensorParallelGroup(shard, store, timeout)
        except RuntimeError as e:
            raise TensorParallelError(f"tensor-parallel rendezvous failed: {e} -- {ranks.describe()}") from e
        device = torch.device(config.device)
        model = load_model(mc, dtype, device, max_positions, show_progress, tp=group)
        k0, k1 = shard.kv_heads(mc)
        kv_cache = allocate_kv_cache(kv_spec.for_kv_heads(k1 - k0), num_blocks, device)
        ranks.wait_ready(LOAD_TIMEOUT_S)
    except BaseException:
        ranks.close()
        raise
    log.info("tensor parallel: %d ranks (pids %s), %d torch threads each", n, ranks.pids, threads)
    return TensorParallelRunner(model, kv_cache, kv_spec.block_size, sampler, group, ranks)
