"""Fixed-size KV blocks: free map, reference counts and the prefix cache's content hashes.

Who owns what: a block is owned by whoever holds a reference (a running sequence's block
table, a decode lease). `allocate` hands out blocks with ref count 1; `free` drops one
reference. At zero a block goes back to the free map, unless it is a full block with computed
KV registered under its content hash (engine/prefix_cache.py): then it stays *cached*, its KV
intact, findable by `lookup` and taken back by `acquire`, until an allocation needs its space
(least recently freed first). Cached blocks count as free for `num_free` and `can_allocate`.
Every block is exactly one of free, cached or owned; `check_integrity` proves it.

Placement keeps each sequence's blocks in one run when it can, because a run of blocks is one
contiguous stretch of the KV pool that attention reads in place, with no gather (the CPU decode
path; kernels/torch_attention.py). A new sequence starts in the middle of the largest free gap,
leaving the rest of the gap for it to grow into; a growing sequence takes the block right after
its last one when that is free. Anything else falls back to the lowest free blocks.

    free map:  ###.............##....###      largest gap: 13 blocks
    new seq:   ###......AAA....##....###      starts at its middle, grows into the dots after
"""

from __future__ import annotations

import re
from collections import OrderedDict

_FREE, _USED = 1, 0
_RUNS = re.compile(b"\x01+")


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self._free_map = bytearray([_FREE]) * num_blocks  # 1 = free (cached blocks are 0: not placeable)
        self._num_empty = num_blocks  # free and holding nothing
        self._ref_counts = [0] * num_blocks
        self.fills = [0] * num_blocks  # allocations of each block so far: its content's generation
        self.block_hash: list[bytes | None] = [None] * num_blocks  # content hash of a registered block
        self._by_hash: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recently freed first
        # (registered?, hash) since the last drain, for workers that report their cache (None: off)
        self.events: list[tuple[bool, bytes]] | None = None

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: empty ones and cached ones (evicted on demand)."""
        return self._num_empty + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Cached blocks no one holds (their KV kept for reuse, reclaimable)."""
        return len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """`n` blocks with ref count 1. `after`: the caller's last block, so the new ones continue
        its run when they can (cached blocks in the way are evicted: a decoding sequence's run
        stays whole). Otherwise cached blocks are evicted least recently freed first, as needed."""
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} blocks, {self.num_free} free")
        if n == 0:
            return []
        out = self._run_after(after, n) if after is not None else None
        if out is None:
            while self._num_empty < n:
                self._evict(next(iter(self._evictable)))
            out = self._run_in_largest_gap(n) or self._lowest_free(n)
        for b in out:
            if self._free_map[b] == _USED:  # cached, in the way of the run
                self._evict(b)
            self._free_map[b] = _USED
            self._ref_counts[b] = 1
            self.fills[b] += 1
        self._num_empty -= n
        return out

    def _evict(self, b: int) -> None:
        del self._evictable[b]
        h = self.block_hash[b]
        assert h is not None
        del self._by_hash[h]
        if self.events is not None:
            self.events.append((False, h))
        self.block_hash[b] = None
        self._free_map[b] = _FREE
        self._num_empty += 1

    def _run_after(self, after: int, n: int) -> list[int] | None:
        """The `n` blocks right after `after`, when each is empty or cached with no holder."""
        start = after + 1
        if start + n > self.num_blocks:
            return None
        for b in range(start, start + n):
            if self._ref_counts[b]:
                return None
        return list(range(start, start + n))

    def _run_in_largest_gap(self, n: int) -> list[int] | None:
        best = max(_RUNS.finditer(self._free_map), key=lambda m: m.end() - m.start(), default=None)
        if best is None or best.end() - best.start() < n:
            return None
        gap = best.end() - best.start()
        start = best.start() + (gap - n) // 2 if best.start() > 0 else best.start()
        return list(range(start, start + n))

    def _lowest_free(self, n: int) -> list[int]:
        out: list[int] = []
        at = 0
        while len(out) < n:
            at = self._free_map.find(b"\x01", at)
            out.append(at)
            at += 1
        return out

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            assert self._ref_counts[b] > 0, f"incref of free block {b}"
            self._ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference each; at zero a registered block stays cached, others go free.
        Free a sequence's blocks tail first: its prefix is then evicted last."""
        for b in block_ids:
            assert self._ref_counts[b] > 0, f"double free of block {b}"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                if self.block_hash[b] is not None:
                    self._evictable[b] = None
                else:
                    self._free_map[b] = _FREE
                    self._num_empty += 1

    # --- the prefix cache -----------------------------------------------------------------
    def register(self, block_id: int, block_hash: bytes) -> None:
        """`block_id` is full and its KV computed for the prefix `block_hash` names: findable
        from now on. A block already registered, or a hash another block holds, stays as it is."""
        if not self.enable_caching or self.block_hash[block_id] is not None or block_hash in self._by_hash:
            return
        assert self._ref_counts[block_id] > 0, f"register of unowned block {block_id}"
        self.block_hash[block_id] = block_hash
        self._by_hash[block_hash] = block_id
        if self.events is not None:
            self.events.append((True, block_hash))

    def hashes(self) -> list[bytes]:
        """Every registered block's hash (owned or cached)."""
        return list(self._by_hash)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The blocks holding the longest leading run of `hashes` (owned or cached); nothing changes."""
        out = []
        for h in hashes:
            b = self._by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_evictable(self, block_ids: list[int]) -> int:
        """How many of these blocks are cached with no holder (acquiring them uses free space)."""
        return sum(1 for b in block_ids if self._ref_counts[b] == 0)

    def acquire(self, block_ids: list[int]) -> None:
        """Take a reference to blocks `lookup` found (a cached one is no longer evictable)."""
        for b in block_ids:
            assert self.block_hash[b] is not None, f"acquire of unregistered block {b}"
            if self._ref_counts[b] == 0:
                del self._evictable[b]
            self._ref_counts[b] += 1

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def check_integrity(self) -> None:
        """Raise unless every block is exactly one of free, cached or owned (leaks, double frees,
        a cached block without its hash, or a free one with a hash)."""
        if self._free_map.count(_FREE) != self._num_empty:
            raise AssertionError("free count disagrees with the free map")
        for b, rc in enumerate(self._ref_counts):
            free, cached = self._free_map[b] == _FREE, b in self._evictable
            if rc < 0:
                raise AssertionError(f"block {b} has negative ref count {rc}")
            if (rc == 0) != (free or cached) or (free and cached):
                raise AssertionError(f"block {b}: ref count {rc}, free {free}, cached {cached}")
            h = self.block_hash[b]
            if (cached or free) and (h is None) == cached:
                raise AssertionError(f"block {b}: cached {cached} but hash {h!r}")
            if h is not None and self._by_hash.get(h) != b:
                raise AssertionError(f"block {b}: its hash maps to {self._by_hash.get(h)}")
        if len(self._by_hash) != sum(h is not None for h in self.block_hash):
            raise AssertionError("hash index disagrees with the blocks' hashes")

    def assert_all_free(self) -> None:
        """Nothing owned: every block free or cached."""
        self.check_integrity()
        if self.num_free != self.num_blocks:
            used = [b for b, rc in enumerate(self._ref_counts) if rc]
            raise AssertionError(f"{len(used)} blocks still referenced: {used[:16]}")
