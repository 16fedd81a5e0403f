"""Fixed-size KV blocks: free list, reference counts and (for prefix reuse) content hashes.

Who owns what: a block is owned by whoever holds a reference (a running sequence's block
table, a decode lease). `allocate` hands out blocks with ref count 1; `free` drops one
reference and returns the block to the free list at zero. Blocks never leak silently:
`check_integrity` proves free list and ref counts agree.
"""
from __future__ import annotations

from collections import deque


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        # Chained content hash of a full block's tokens (prefix-aware transfer and caching).
        self.block_hash: list[int | None] = [None] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._ref_counts[b] = 1
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
                self._free.append(b)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def check_integrity(self) -> None:
        """Raise if free list and ref counts disagree (duplicates, leaks, negative counts)."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError("duplicate block in free list")
        for b, rc in enumerate(self._ref_counts):
            if rc < 0:
                raise AssertionError(f"block {b} has negative ref count {rc}")
            if (rc == 0) != (b in free):
                raise AssertionError(f"block {b}: ref count {rc} but in free list: {b in free}")

    def assert_all_free(self) -> None:
        self.check_integrity()
        if self.num_free != self.num_blocks:
            used = [b for b, rc in enumerate(self._ref_counts) if rc]
            raise AssertionError(f"{len(used)} blocks still referenced: {used[:16]}")
