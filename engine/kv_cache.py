"""Paged KV pool: sizing from a memory budget (checked at start-up against one max-length sequence
and, on the CPU, against the host memory available) and allocation.

Layout `[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`: each layer's K and V
are one contiguous slab, so a layer can be shipped (or mapped by a peer) as a unit. Under tensor
parallelism every rank holds such a pool for its own KV heads, with the same block count and ids;
the memory budget counts all of the model's heads (replicated heads cost once per rank on top).

`--kv-cache-dtype int8|fp8`: the pool's dtype is int8 (fp8: uint8, e4m3 bits) and its last axis
`head_dim + 4` (each row's fp32 scale after its values, kernels/kv_quant.py): scales live in the
same allocation, so a shared-memory pool holds them too and every block copy carries them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.engine.config import CacheConfig, ModelConfig
from pdserve.kernels import kv_quant

# (shape, dtype) -> tensor; e.g. a shared-memory allocator so a prefill peer can write in place.
KvAllocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # what the pool stores: the model's dtype, or int8 / uint8 (fp8) rows + scales

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
    ) -> "KVCacheSpec":
        """`dtype`: the model's; `kv_cache_dtype` (--kv-cache-dtype): "auto" stores it, "int8" int8
        rows, "fp8" e4m3 rows (a uint8 pool)."""
        stored = kv_quant.pool_dtype(kv_cache_dtype, dtype)
        kv_quant.row_width(cfg.head_dim, stored)  # refuses a head_dim quantized rows cannot hold
        return cls(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, stored)

    def for_kv_heads(self, num_kv_heads: int) -> "KVCacheSpec":
        """The same pool for a tensor-parallel rank holding `num_kv_heads` of the heads."""
        return KVCacheSpec(self.num_layers, self.block_size, num_kv_heads, self.head_dim, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.row_width * elem

    @property
    def row_width(self) -> int:
        """Elements of one token's row for one head: head_dim (int8, fp8: + its scale's 4 bytes)."""
        return kv_quant.row_width(self.head_dim, self.dtype)

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.row_width)


def plan_num_blocks(spec: KVCacheSpec, cache: CacheConfig, max_model_len: int, draft: KVCacheSpec | None = None) -> int:
    """Blocks to allocate; refuses when one max-length sequence would not fit. With a draft
    model (engine/spec/draft_model.py) a block holds the draft's layers too, at the same block
    id in the draft's pool: the memory budget pays for both, so it means the same memory."""
    block_bytes = spec.bytes_per_block + (draft.bytes_per_block if draft is not None else 0)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
        source = f"--num-blocks {num_blocks}"
    else:
        num_blocks = cache.memory_bytes // block_bytes
        source = f"--kv-cache-memory {cache.memory_bytes / 2**20:.1f} MiB"
    needed = -(-max_model_len // spec.block_size)
    if num_blocks < needed:
        raise ValueError(
            f"KV cache too small: {source} gives {num_blocks} blocks of {spec.block_size} tokens "
            f"({block_bytes / 2**10:.1f} KiB each{', draft layers included' if draft else ''}), but one sequence of max_model_len="
            f"{max_model_len} needs {needed}. Raise the KV budget or lower --max-model-len."
        )
    return num_blocks


HEADROOM_BYTES = 256 << 20  # host memory a pool must leave free (activations, buffers, the rest of the step)


def available_host_memory() -> int | None:
    """Bytes the kernel says can still be given out without swapping (MemAvailable), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_memory(pool_bytes: int, num_blocks: int, block_size: int) -> None:
    """Refuse, with the numbers, a host KV pool the machine cannot hold next to what is loaded:
    zeroing it would otherwise have the kernel kill the process mid-start."""
    free = available_host_memory()
    if free is None or pool_bytes + HEADROOM_BYTES <= free:
        return
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    fits = max(0, (free - HEADROOM_BYTES) * num_blocks // pool_bytes)
    raise MemoryError(
        f"KV cache of {num_blocks} blocks x {block_size} tokens needs {gib(pool_bytes)}, but this machine has "
        f"{gib(free)} available after loading the model (and keeps {gib(HEADROOM_BYTES)} for the steps): "
        f"about {fits} blocks ({fits * block_size} tokens) fit. Lower --kv-cache-memory (or --num-blocks), "
        f"and --max-model-len with it."
    )


def allocate_kv_cache(
    spec: KVCacheSpec, num_blocks: int, device: torch.device, allocator: KvAllocator | None = None
) -> torch.Tensor:
    shape = spec.shape(num_blocks)
    if device.type == "cpu":  # (a shared-memory allocator's pages are host memory too)
        check_host_memory(spec.bytes_per_block * num_blocks, num_blocks, spec.block_size)
    if allocator is not None:
        cache = allocator(shape, spec.dtype)
        if tuple(cache.shape) != shape or cache.dtype != spec.dtype:
            raise ValueError(f"KV allocator returned {tuple(cache.shape)}/{cache.dtype}, expected {shape}/{spec.dtype}")
        cache.zero_()
        return cache
    return torch.zeros(shape, dtype=spec.dtype, device=device)  # [L, 2, N, bs, Hkv, D] (int8, fp8: D + 4)
