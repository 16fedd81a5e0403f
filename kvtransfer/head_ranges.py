"""KV heads across tensor-parallel degrees: which rank pool holds which heads, and where a frame's
head range lands on the other side.

A worker of TP degree N keeps one KV pool per rank, each for its own heads [start, end) (or one
head replicated on N/Hkv ranks when Hkv < N). Its rank 0 addresses them all (shared memory), so:

    sender    one frame per distinct head range (replicas skipped): heads [s, e) of the model
    receiver  each frame's heads written into every rank pool whose range overlaps them

    P (TP=2, Hkv=4)   rank0 [0,2)  rank1 [2,4)        frames [0,2) and [2,4)
    D (TP=1)          rank0 [0,4)                     [0,2) -> heads 0..1, [2,4) -> heads 2..3
    D (TP=4, Hkv=2)   [0,1) [0,1) [1,2) [1,2)         P (TP=1) frame [0,2): head 0 -> ranks 0, 1;
                                                      head 1 -> ranks 2, 3 (replicas all written)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rank_kv_heads(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """The KV heads [start, end) rank `rank` of `size` holds: a share of them, or, with fewer
    heads than ranks (`size` a multiple of them), one head replicated on size/num_kv_heads ranks."""
    if num_kv_heads >= size:
        per = num_kv_heads // size
        return rank * per, (rank + 1) * per
    head = rank // (size // num_kv_heads)
    return head, head + 1


@dataclass(frozen=True)
class HeadShard:
    """One rank's KV pool [L, 2, N, bs, end - start, D], holding the model's KV heads [start, end);
    `shm_name`: the shared-memory segment it lives in, when it is one (a tensor-parallel rank's)."""

    start: int
    end: int
    pool: torch.Tensor
    shm_name: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end or self.pool.dim() != 6 or self.pool.shape[4] != self.end - self.start:
            raise ValueError(f"KV heads [{self.start}, {self.end}) do not fit a pool of {list(self.pool.shape)}")


@dataclass(frozen=True)
class HeadOverlap:
    """Heads a frame and a rank pool share: frame heads [src, src + n) -> pool heads [dst, dst + n)."""

    shard: HeadShard
    src: int
    dst: int
    count: int


def distinct_shards(shards: list[HeadShard]) -> list[HeadShard]:
    """One shard per head range, in head order (replicated heads are sent once)."""
    seen: dict[tuple[int, int], HeadShard] = {}
    for s in shards:
        seen.setdefault((s.start, s.end), s)
    return [seen[k] for k in sorted(seen)]


def head_span(shards: list[HeadShard]) -> tuple[int, int]:
    """[first, last) KV head held; raises unless the shards cover it without a gap."""
    if not shards:
        raise ValueError("no KV pools")
    covered = set().union(*(range(s.start, s.end) for s in shards))
    lo, hi = min(covered), max(covered) + 1
    if len(covered) != hi - lo:
        raise ValueError(f"KV pools leave heads of [{lo}, {hi}) uncovered")
    return lo, hi


def overlaps(start: int, end: int, shards: list[HeadShard]) -> list[HeadOverlap]:
    """Where frame heads [start, end) go: every shard holding some of them (replicas included)."""
    out = []
    for s in shards:
        lo, hi = max(start, s.start), min(end, s.end)
        if lo < hi:
            out.append(HeadOverlap(s, lo - start, lo - s.start, hi - lo))
    return out
