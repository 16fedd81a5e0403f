"""The engine's side of the disk tier (engine/kv_disk_tier.py): a block registered with the prefix
cache is copied out of the pool for the tier to write; a waiting prompt's blocks found on disk are
read ahead when it arrives and loaded into pool blocks, registered as cached, just before the
scheduler looks up its prefix, which then finds them as it finds any cached block.

A block's bytes are its slice of every pool the engine keeps per block id: the target model's
`[L, 2, bs, Hkv, W]` and, with a draft model, the draft's, side by side in that order.
"""

from __future__ import annotations

import torch

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.kv_disk_tier import DiskKvTier


class KvOffload:
    def __init__(self, tier: DiskKvTier, pool: BlockPool, caches: list[torch.Tensor], block_size: int) -> None:
        self.tier, self.pool, self.caches, self.block_size = tier, pool, caches, block_size
        self.block_nbytes = sum(c[:, :, 0].numel() * c.element_size() for c in caches)
        self.loaded_blocks = 0  # blocks read back from disk into the pool (counter)

    def _block_bytes(self, block_id: int) -> bytes:
        return b"".join(c[:, :, block_id].contiguous().cpu().view(torch.uint8).numpy().tobytes() for c in self.caches)

    def _load(self, block_id: int, payload: memoryview) -> None:
        data = torch.frombuffer(payload, dtype=torch.uint8)  # (the tier's writable read buffer: no copy)
        at = 0
        for c in self.caches:
            dst = c[:, :, block_id]  # [L, 2, bs, Hkv, W]
            n = dst.numel() * dst.element_size()
            dst.copy_(data[at : at + n].view(c.dtype).view(dst.shape))
            at += n

    def written(self, block_id: int, block_hash: bytes) -> None:
        """`block_id` was just registered as `block_hash`: its KV goes to disk unless already there."""
        if block_hash not in self.tier:
            self.tier.put(block_hash, self._block_bytes(block_id))

    def prefetch(self, hashes: list[bytes]) -> None:
        """A prompt arrived: start reading the blocks past its RAM-cached prefix that disk holds."""
        ram = len(self.pool.lookup(hashes))
        n = self.tier.leading(hashes[ram:])
        if n:
            self.tier.prefetch(hashes[ram : ram + n])

    def load_prefix(self, hashes: list[bytes]) -> int:
        """Bring the blocks past the RAM-cached run of `hashes` that disk holds into the pool, as
        cached blocks (as many as free space allows, in order); returns how many came back. The RAM
        run is held meanwhile so making room evicts none of it."""
        ram = self.pool.lookup(hashes)
        want = self.tier.leading(hashes[len(ram) :])
        room = self.pool.num_free - self.pool.num_evictable(ram)
        n = min(want, room)
        if n <= 0:
            return 0
        self.pool.acquire(ram)
        try:
            blocks = self.pool.allocate(n)
            loaded = 0
            for b, h in zip(blocks, hashes[len(ram) : len(ram) + n]):
                payload = self.tier.take(h)
                if payload is None or len(payload) != self.block_nbytes:
                    break  # (a corrupt or foreign file: the rest of the prompt is computed)
                self._load(b, payload)
                self.pool.register(b, h)
                loaded += 1
            self.pool.free(blocks[::-1])  # registered ones stay cached, in prefix order for eviction
        finally:
            self.pool.free(ram[::-1])
        self.loaded_blocks += loaded
        return loaded

    def stats(self) -> dict[str, int]:
        """WorkerStats' kv_disk_* fields."""
        c = self.tier.counters
        return {
            "kv_disk_blocks": self.tier.num_blocks,
            "kv_disk_bytes": self.tier.bytes_used,
            "kv_disk_capacity_bytes": self.tier.capacity_bytes,
            "kv_disk_hit_tokens": self.loaded_blocks * self.block_size,
            "kv_disk_writes": c.writes,
            "kv_disk_write_bytes": c.write_bytes,
            "kv_disk_reads": c.reads,
            "kv_disk_read_bytes": c.read_bytes,
            "kv_disk_evictions": c.evictions,
            "kv_disk_corrupt": c.corrupt,
            "kv_disk_dropped_writes": c.dropped_writes,
        }
