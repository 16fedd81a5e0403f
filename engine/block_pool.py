"""Fixed-size KV blocks: free map, reference counts and (for prefix reuse) content hashes.

Who owns what: a block is owned by whoever holds a reference (a running sequence's block
table, a decode lease). `allocate` hands out blocks with ref count 1; `free` drops one
reference and returns the block to the free map at zero. Blocks never leak silently:
`check_integrity` proves free map and ref counts agree.

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

_FREE, _USED = 1, 0
_RUNS = re.compile(b"\x01+")


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self._free_map = bytearray([_FREE]) * num_blocks  # 1 = free
        self._num_free = num_blocks
        self._ref_counts = [0] * num_blocks
        # Chained content hash of a full block's tokens (prefix-aware transfer and caching).
        self.block_hash: list[int | None] = [None] * num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._num_free

    def can_allocate(self, n: int) -> bool:
        return n <= self._num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """`n` blocks with ref count 1. `after`: the caller's last block, so the new ones continue
        its run when they can."""
        if n > self._num_free:
            raise NoFreeBlocks(f"need {n} blocks, {self._num_free} free")
        if n == 0:
            return []
        out = self._run_after(after, n) if after is not None else None
        if out is None:
            out = self._run_in_largest_gap(n) or self._lowest_free(n)
        for b in out:
            self._free_map[b] = _USED
            self._ref_counts[b] = 1
        self._num_free -= n
        return out

    def _run_after(self, after: int, n: int) -> list[int] | None:
        start = after + 1
        if start + n <= self.num_blocks and self._free_map.find(b"\x00", start, start + n) == -1:
            return list(range(start, start + n))
        return None

    def _run_in_largest_gap(self, n: int) -> list[int] | None:
        best = max(_RUNS.finditer(self._free_map), key=lambda m: m.end() - m.start(), default=None)
        if best is None or best.end() - best.start() < n:
            return None
        gap = best.end() - best.start()
        start = best.start() + (gap - n) // 2 if best.start() > 0 else best.start()
        return list(range(start, start + n))

    def _lowest_free(self, n: int) -> list[int]:
        out, at = [], 0
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
        for b in block_ids:
            assert self._ref_counts[b] > 0, f"double free of block {b}"
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self.block_hash[b] = None
                self._free_map[b] = _FREE
                self._num_free += 1

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def check_integrity(self) -> None:
        """Raise if free map and ref counts disagree (leaks, double frees, negative counts)."""
        if self._free_map.count(_FREE) != self._num_free:
            raise AssertionError("free count disagrees with the free map")
        for b, rc in enumerate(self._ref_counts):
            if rc < 0:
                raise AssertionError(f"block {b} has negative ref count {rc}")
            if (rc == 0) != (self._free_map[b] == _FREE):
                raise AssertionError(f"block {b}: ref count {rc} but free: {self._free_map[b] == _FREE}")

    def assert_all_free(self) -> None:
        self.check_integrity()
        if self.num_free != self.num_blocks:
            used = [b for b, rc in enumerate(self._ref_counts) if rc]
            raise AssertionError(f"{len(used)} blocks still referenced: {used[:16]}")
