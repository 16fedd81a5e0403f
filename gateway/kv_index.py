"""What KV each worker holds, as the gateway learns it from heartbeats, and how routing uses it.

Workers report their prefix cache's block ids (protocol/block_hashes.py `short_id`: the first 8
bytes of a block's hash) as `KvDigest`s: deltas since their previous heartbeat, and every few
seconds the whole set. A digest out of sequence (a heartbeat lost) drops that worker's entry
until its next full set, so the index is never confidently wrong for long; and it is only a
hint: the decode worker checks the real hashes itself at reservation.

How routing uses it: gateway/router.py.
"""

from __future__ import annotations

from pdserve.protocol.messages import KvDigest


class KvIndex:
    def __init__(self) -> None:
        self._held: dict[str, set[int]] = {}  # worker id -> block ids it holds
        self._seq: dict[str, int] = {}  # worker id -> the last digest applied

    def apply(self, worker_id: str, digest: KvDigest) -> None:
        if digest.full:
            self._held[worker_id] = set(digest.stored)
        elif self._seq.get(worker_id) == digest.seq - 1:
            held = self._held[worker_id]
            held.difference_update(digest.removed)
            held.update(digest.stored)
        else:  # a digest went missing (or this gateway is new): unknown until the next full set
            self._held.pop(worker_id, None)
            self._seq.pop(worker_id, None)
            return
        self._seq[worker_id] = digest.seq

    def forget(self, worker_id: str) -> None:
        self._held.pop(worker_id, None)
        self._seq.pop(worker_id, None)

    def num_held(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

    def leading_blocks(self, worker_id: str, block_ids: list[int]) -> int:
        """How many of the prompt's leading blocks the worker holds (0 when unknown)."""
        held = self._held.get(worker_id)
        if not held:
            return 0
        n = 0
        for b in block_ids:
            if b not in held:
                break
            n += 1
        return n
