"""Model folders and engines for the tensor-parallel tests: the two families they check."""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.modelgen.make_model import make_model


def single_kv_head_qwen2(folder: Path) -> Path:
    """Qwen2 (qkv bias, tied embeddings) with 4 heads sharing one KV head: replicated under TP=2."""
    return make_model(folder, preset="tiny", arch="qwen2", seed=5, quiet=True, num_kv_heads=1)


def tp_engine(model: Path, tp: int, **kw) -> LLMEngine:
    cache = CacheConfig(block_size=kw.pop("block_size", 4), num_blocks=kw.pop("num_blocks", 256))
    sched = SchedulerConfig(
        max_num_seqs=kw.pop("max_num_seqs", 16),
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 512),
        max_model_len=kw.pop("max_model_len", 256),
    )
    config = EngineConfig(
        model=str(model), dtype="float32", cache=cache, scheduler=sched, tensor_parallel_size=tp, **kw
    )
    return LLMEngine(config, show_progress=False)
