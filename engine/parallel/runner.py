"""Rank 0 of a tensor-parallel engine: starts the other ranks, and each step broadcasts what
their forward needs before running its own shard of the same layers; it alone samples.

    rank 0 (this process: scheduler, block pool, prefix cache, sampler)
      begin:      ring ranks -> broadcast step (batch + block copies) -> embed (all-reduce)
      run_layers: per layer: attention (all-reduce), MLP (all-reduce)      } same order on
      logits:     LM head slice -> gather on rank 0                       } every rank

Every rank's KV pool lives in shared memory rank 0 creates (a segment per rank, named in its
RankConfig, unlinked when rank 0 closes), so rank 0 reads and writes every rank's KV heads
(`kv_head_shards`: a prefill worker ships them, a decode worker lands them) with no collective.
A prefill worker's per-layer hook runs once the layer is done on rank 0 and ships rank 0's own
KV heads; each other rank ships its own heads (kvtransfer/rank_sends.py), planned by rank 0
and broadcast with the step (`PlansRankSends`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Protocol, runtime_checkable

import torch

from pdserve.engine.batch import build_batch
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.kv_cache import KvAllocator, KVCacheSpec, allocate_kv_cache
from pdserve.engine.model_runner import ForwardPass, ModelRunner, load_model
from pdserve.engine.models.interface import CausalLM
from pdserve.engine.models.llama import ForwardContext
from pdserve.engine.parallel.core_sets import pin, rank_cores
from pdserve.engine.parallel.group import TensorParallelError, TensorParallelGroup, host_store
from pdserve.engine.parallel.rank_config import RankConfig
from pdserve.engine.parallel.ranks import RankProcesses
from pdserve.engine.parallel.shard import TensorParallelShard, check_tensor_parallel
from pdserve.engine.parallel.step_inputs import send_step
from pdserve.engine.sampler import Sampler
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.kvtransfer.head_ranges import HeadShard
from pdserve.kvtransfer.shm import SharedTensor

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 1800.0  # the ranks loading their shards (rank 0 loads its own meanwhile)


@runtime_checkable
class PlansRankSends(Protocol):
    """A step's per-layer hook that also plans the ranks' own KV sends (prefill_node/kv_streamer.py)."""

    def rank_plan(self) -> bytes: ...


class TensorParallelRunner(ModelRunner):
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        sampler: Sampler,
        group: TensorParallelGroup,
        ranks: RankProcesses,
        shards: list[HeadShard],
        pools: list[SharedTensor],
        unpinned: list[int] | None = None,
    ) -> None:
        super().__init__(model, kv_cache, block_size, sampler)
        self.group, self.ranks = group, ranks
        self._shards = shards  # rank order, rank 0's (kv_cache) first
        self._pools = pools  # ranks 1..N-1's shared memory, unlinked at close
        self._unpinned = unpinned  # this process's cores before rank 0 was pinned

    @property
    def kv_head_shards(self) -> list[HeadShard]:
        return self._shards

    @torch.inference_mode()
    def begin(self, sched: SchedulerOutput, on_layer_stored: Callable[[int], None] | None = None) -> ForwardPass:
        batch = build_batch(sched.chunks, len(sched.decodes), self.block_size, self.device)
        try:
            self.ranks.ring()
            plan = on_layer_stored.rank_plan() if isinstance(on_layer_stored, PlansRankSends) else b""
            send_step(self.group, batch, sched.block_copies, plan)
            if sched.block_copies:
                src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*sched.block_copies))
                self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]  # [L, 2, C, bs, Hkv, D]
            ctx = ForwardContext(batch.attn, batch.slot_mapping, self.kv_cache)
            x, rope = self.model.embed(batch.input_ids, batch.positions)  # [T, H]
        except TensorParallelError as e:
            raise self._failed(e) from e
        return ForwardPass(batch, ctx, x, rope, after_layer=on_layer_stored)

    def run_layers(self, fp: ForwardPass, count: int | None = None) -> None:
        stop = self.num_layers if count is None else min(self.num_layers, fp.next_layer + count)
        try:
            while fp.next_layer < stop:
                super().run_layers(fp, 1)
                if fp.after_layer is not None:
                    fp.after_layer(fp.next_layer - 1)
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
        for pool in self._pools:
            pool.close()
        pin(self._unpinned)
        self._unpinned = None


def start_tensor_parallel(
    config: EngineConfig,
    mc: ModelConfig,
    dtype: torch.dtype,
    kv_spec: KVCacheSpec,
    num_blocks: int,
    max_positions: int,
    sampler: Sampler,
    show_progress: bool,
    kv_allocator: KvAllocator | None = None,
    kv_payload_mac: str | None = None,
) -> TensorParallelRunner:
    """Start ranks 1..N-1, load rank 0's shard here, and return rank 0's runner once all are ready.
    Each rank gets this process's torch threads / N (at least one) and, where the process may run
    on at least N cores, cores of its own (core_sets.py): rank 0 is pinned here, the others at start.
    `kv_allocator` makes rank 0's KV pool (a decode worker's: in shared memory, so prefill workers
    write every rank in place). `kv_payload_mac` (a prefill worker's mode): ranks 1..N-1 send their
    own KV heads."""
    n, timeout = config.tensor_parallel_size, config.tensor_parallel_timeout_s
    shard = TensorParallelShard(0, n)
    check_tensor_parallel(mc, n)
    threads = max(1, torch.get_num_threads() // n)
    cores = rank_cores(n) if config.device == "cpu" else None
    unpinned = pin(cores[0] if cores else None)  # this process's cores before, restored at close
    torch.set_num_threads(threads)
    heads = [TensorParallelShard(rank, n).kv_heads(mc) for rank in range(n)]
    pools: list[SharedTensor] = []  # ranks 1..N-1's KV pools: rank 0 maps them too
    try:
        for k0, k1 in heads[1:]:
            pools.append(SharedTensor.create(kv_spec.for_kv_heads(k1 - k0).shape(num_blocks), kv_spec.dtype))
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
                    kv_pool_shm=pools[rank - 1].name,
                    cpus=cores[rank] if cores else [],
                    kv_payload_mac=kv_payload_mac,
                    kv_cache_dtype=config.cache.kv_cache_dtype,
                )
                for rank in range(1, n)
            ]
        )
    except BaseException:
        for pool in pools:
            pool.close()
        pin(unpinned)
        raise
    try:
        try:
            group = TensorParallelGroup(shard, store, timeout)
        except RuntimeError as e:
            raise TensorParallelError(f"tensor-parallel rendezvous failed: {e} -- {ranks.describe()}") from e
        device = torch.device(config.device)
        model = load_model(mc, dtype, device, max_positions, show_progress, tp=group)
        k0, k1 = heads[0]
        kv_cache = allocate_kv_cache(kv_spec.for_kv_heads(k1 - k0), num_blocks, device, kv_allocator)
        ranks.wait_ready(LOAD_TIMEOUT_S)
    except BaseException:
        ranks.close()
        for pool in pools:
            pool.close()
        pin(unpinned)
        raise
    log.info(
        "tensor parallel: %d ranks (pids %s), %d torch threads each, cores %s",
        n,
        ranks.pids,
        threads,
        " | ".join(",".join(map(str, c)) for c in cores) if cores else "unpinned",
    )
    tensors = [kv_cache] + [p.tensor for p in pools if p.tensor is not None]
    names = [None] + [p.name for p in pools]
    shards = [HeadShard(k0, k1, t, name) for (k0, k1), t, name in zip(heads, tensors, names, strict=True)]
    return TensorParallelRunner(model, kv_cache, kv_spec.block_size, sampler, group, ranks, shards, pools, unpinned)
