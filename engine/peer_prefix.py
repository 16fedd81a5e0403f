"""The engine's side of prefix fetches between workers (kvtransfer/prefix_exporter.py,
prefix_fetcher.py): copy a prompt's cached blocks out for a peer, and load blocks a peer sent into
this pool as cached blocks under their hashes, so the scheduler finds them as any cached block.

A block's KV is its slice of every pool the engine keeps per block id, as the disk tier's
(engine/kv_offload.py): the target's `[L, 2, bs, Hkv, W]`, then a draft model's. On the wire, one
payload per layer holds that layer's K and V of all the blocks: `[2, n, bs, Hkv, W]`.
"""

from __future__ import annotations

import warnings

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.kvtransfer.sender import copy_blocks


class PeerPrefix:
    def __init__(self, pool: BlockPool, caches: list[torch.Tensor]) -> None:
        self.pool, self.caches = pool, caches  # each [L, 2, N, bs, H, W]
        self.loaded_blocks = 0  # blocks loaded from peers (counter)

    def export(self, hashes: list[bytes]) -> list[torch.Tensor]:
        """Copies of the leading run of `hashes` this pool holds, one per pool ([L, 2, n, bs, H, W]
        on the CPU, contiguous); [] when it holds none. The blocks are pinned while copied."""
        blocks = self.pool.lookup(hashes)
        if not blocks:
            return []
        self.pool.acquire(blocks)
        try:
            return [c.index_select(2, torch.tensor(blocks, device=c.device)).cpu().contiguous() for c in self.caches]
        finally:
            self.pool.free(blocks[::-1])

    def load(self, prompt_hashes: list[bytes], first: int, layers: list[memoryview]) -> int:
        """Load blocks a peer sent: `layers` (one payload a layer, target's then draft's, each
        `[2, k, bs, H, W]`) hold the blocks `prompt_hashes[first : first + k]`. Only what extends
        the leading run this pool holds now is loaded (as much as free room allows, its run held
        meanwhile so making room evicts none of it), registered as cached; returns how many."""
        if not layers:
            return 0
        per_layer = [(c, layer) for c in self.caches for layer in range(c.shape[0])]
        if len(layers) != len(per_layer):
            raise ValueError(f"{len(layers)} layer payloads for {len(per_layer)} layers")
        c0 = self.caches[0]
        k = layers[0].nbytes // (c0[0, :, 0].numel() * c0.element_size())
        held = self.pool.lookup(prompt_hashes[: first + k])
        if len(held) < first:  # (an earlier block left the cache meanwhile: these would sit unused)
            return 0
        skip = len(held) - first
        n = min(k - skip, self.pool.num_free - self.pool.num_evictable(held))
        if n <= 0:
            return 0
        self.pool.acquire(held)
        try:
            blocks = self.pool.allocate(n)
            src = list(range(skip, skip + n))
            for (cache, layer), payload in zip(per_layer, layers, strict=True):
                dst = cache[layer]  # [2, N, bs, H, W]
                with warnings.catch_warnings():  # a read-only ZMQ buffer: only read from
                    warnings.simplefilter("ignore", UserWarning)
                    data = torch.frombuffer(payload, dtype=torch.uint8)
                data = data.view(cache.dtype).view(2, k, *dst.shape[2:]).to(dst.device)
                copy_blocks(dst, blocks, data, src)
            for b, h in zip(blocks, prompt_hashes[first + skip : first + skip + n], strict=True):
                self.pool.register(b, h)
            self.pool.free(blocks[::-1])  # registered: they stay cached, prefix order for eviction
        finally:
            self.pool.free(held[::-1])
        self.loaded_blocks += n
        return n
