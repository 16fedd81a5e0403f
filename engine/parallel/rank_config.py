"""What a rank process is told at start: one typed struct, msgspec JSON on the first line of its
stdin (nothing pickled)."""

from __future__ import annotations

import msgspec


class RankConfig(msgspec.Struct, frozen=True):
    model: str  # HF folder or GGUF file
    model_impl: str
    dtype: str  # resolved: float32 | bfloat16 | float16
    device: str
    max_positions: int
    block_size: int
    num_blocks: int
    rank: int
    size: int
    store_port: int  # rank 0's rendezvous TCPStore on 127.0.0.1
    timeout_s: float
    threads: int  # torch threads of this rank
    kv_pool_shm: str  # the shared-memory segment rank 0 made for this rank's KV pool (it maps it too)
    cpus: list[int] = []  # the cores this rank runs on (engine/parallel/core_sets.py); empty: unpinned
    # a prefill worker's rank sends its own KV heads (kvtransfer/rank_sends.py) with this
    # --kv-payload-mac mode; None: it sends nothing (decode and colocated workers)
    kv_payload_mac: str | None = None
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: the pool stores the model's dtype, or int8 / fp8 rows
