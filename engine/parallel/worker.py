"""A tensor-parallel rank process (rank >= 1): loads its shard of the weights and its KV heads'
pool, then runs each step rank 0 rings for (engine/parallel/ranks.py: the stdin protocol).

    python -m pdserve.engine.parallel.worker    (started by rank 0 only)

It never outlives rank 0: end of file on stdin ends it, and a collective with a dead rank 0
fails at once (the peer's socket closes) and ends it too.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import BinaryIO

import msgspec
import torch

from pdserve.engine.config import ModelConfig, resolve_dtype
from pdserve.engine.kv_cache import KVCacheSpec
from pdserve.engine.model_runner import load_model
from pdserve.engine.models.llama import ForwardContext, LlamaForCausalLM
from pdserve.engine.parallel.core_sets import pin
from pdserve.engine.parallel.group import TensorParallelError, TensorParallelGroup, join_store
from pdserve.engine.parallel.rank_config import RankConfig
from pdserve.engine.parallel.ranks import STEP
from pdserve.engine.parallel.shard import TensorParallelShard
from pdserve.engine.parallel.step_inputs import StepInputs, receive_step
from pdserve.env import settings
from pdserve.kvtransfer.rank_sends import RankKvSends, sends_own_heads
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.protocol.auth import FrameAuth, load_cluster_secret

log = logging.getLogger("pdserve.tensor_parallel")


def load_rank(cfg: RankConfig, group: TensorParallelGroup) -> tuple[LlamaForCausalLM, SharedTensor]:
    """This rank's model shard and KV pool [L, 2, N, bs, Hkv/N, D] (same blocks as rank 0's), in
    the shared memory rank 0 made for it (rank 0 reads and writes its KV there: transfers)."""
    device = torch.device(cfg.device)
    mc = ModelConfig.from_folder(cfg.model, cfg.model_impl)
    dtype = resolve_dtype(cfg.dtype, device)
    model = load_model(mc, dtype, device, cfg.max_positions, show_progress=False, tp=group)
    assert isinstance(model, LlamaForCausalLM)
    k0, k1 = group.shard.kv_heads(mc)
    spec = KVCacheSpec.for_model(mc, cfg.block_size, dtype, cfg.kv_cache_dtype).for_kv_heads(k1 - k0)
    return model, SharedTensor.attach(cfg.kv_pool_shm, spec.shape(cfg.num_blocks), spec.dtype)


def rank_kv_sends(cfg: RankConfig, pool: torch.Tensor) -> RankKvSends | None:
    """This rank's own KV sends (a prefill worker's rank holding a head range no lower rank holds)."""
    if cfg.kv_payload_mac is None:
        return None
    mc = ModelConfig.from_folder(cfg.model, cfg.model_impl)
    heads = [TensorParallelShard(r, cfg.size).kv_heads(mc) for r in range(cfg.size)]
    if not sends_own_heads(cfg.rank, heads):
        return None
    return RankKvSends(pool, heads[cfg.rank], FrameAuth(load_cluster_secret()), cfg.kv_payload_mac)


@torch.inference_mode()
def run_step(
    model: LlamaForCausalLM, kv_cache: torch.Tensor, step: StepInputs, sends: RankKvSends | None = None
) -> None:
    """The same forward as rank 0's ModelRunner, on this rank's shard (collectives in lockstep);
    `sends` ship this rank's KV heads as each layer stores them, when the step plans any."""
    if step.copy_src.numel():
        kv_cache[:, :, step.copy_dst] = kv_cache[:, :, step.copy_src]  # [L, 2, C, bs, Hkv, D]
    hook = None
    if sends is not None and step.kv_plan:
        sends.plan(step.kv_plan)
        hook = sends
    ctx = ForwardContext(step.attn, step.slot_mapping, kv_cache, hook)
    x, rope = model.embed(step.input_ids, step.positions)  # [T, H]
    for layer in model.layers:
        x = layer(x, rope, ctx)
    if step.logits_indices.numel():
        model.head(x, step.logits_indices)  # this rank's vocabulary slice, gathered on rank 0


def serve_rank(cfg: RankConfig, commands: BinaryIO, answers: BinaryIO) -> int:
    pin(cfg.cpus)
    torch.set_num_threads(cfg.threads)
    shard = TensorParallelShard(cfg.rank, cfg.size)
    try:
        group = TensorParallelGroup(shard, join_store(cfg.store_port, cfg.size, cfg.timeout_s), cfg.timeout_s)
        model, pool = load_rank(cfg, group)
        assert pool.tensor is not None
        kv_cache = pool.tensor
        sends = rank_kv_sends(cfg, kv_cache)
    except Exception as e:  # rank 0 reports it
        answers.write(f"error: {type(e).__name__}: {e}\n".encode())
        answers.flush()
        return 1
    answers.write(b"ready\n")
    answers.flush()
    try:
        while commands.read(1) == STEP:
            try:
                run_step(model, kv_cache, receive_step(group), sends)
            except TensorParallelError as e:
                log.error("rank %d: %s; exiting", cfg.rank, e)
                return 1
        return 0  # end of file: rank 0 closed the engine, or is gone
    finally:
        if sends is not None:
            sends.close()


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to answer; its exit ends this rank
    answers = os.fdopen(os.dup(1), "wb")  # the protocol's stdout; anything printed goes to stderr
    os.dup2(2, 1)
    commands = sys.stdin.buffer
    cfg = msgspec.json.decode(commands.readline(), type=RankConfig)
    logging.basicConfig(
        level=settings().log_level, format=f"%(asctime)s tp-rank-{cfg.rank} %(levelname)s %(name)s: %(message)s"
    )
    return serve_rank(cfg, commands, answers)


if __name__ == "__main__":
    sys.exit(main())
