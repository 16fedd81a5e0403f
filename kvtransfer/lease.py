"""Decode-side KV leases: who may write which blocks, fenced by epoch and deadline.

    grant --> active --KvDone ok--> release (blocks handed to the running sequence)
                 \\--abort / deadline passed--> quarantine --deadline--> reclaimable
Epochs start at a random 62-bit value per process and only grow, so a frame meant for an
earlier lease (or an earlier process) never matches. Blocks of an aborted lease stay
quarantined until its deadline: a prefill worker refuses to write after the deadline, so
no late write can land in blocks that by then belong to another request.
"""
from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field

from protocol.messages import KvDone, KvLayer, Lease


@dataclass
class _Active:
    lease: Lease
    covered: dict[int, set[int]] = field(default_factory=dict)  # layer -> blocks written


class LeaseTable:
    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self._next_epoch = secrets.randbits(62)
        self._active: dict[str, _Active] = {}
        self._quarantine: list[tuple[float, list[int]]] = []

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(b) for _, b in self._quarantine)

    def grant(self, request_id: str, block_ids: list[int], ttl_s: float) -> Lease:
        if request_id in self._active:
            raise ValueError(f"lease for {request_id} exists")
        self._next_epoch += 1
        lease = Lease(epoch=self._next_epoch, block_ids=list(block_ids), deadline=time.time() + ttl_s)
        self._active[request_id] = _Active(lease)
        return lease

    def get(self, request_id: str) -> Lease | None:
        entry = self._active.get(request_id)
        return entry.lease if entry else None

    def _check(self, request_id: str, epoch: int, now: float) -> tuple[_Active | None, str | None]:
        entry = self._active.get(request_id)
        if entry is None:
            return None, "unknown_lease"
        if entry.lease.epoch != epoch:
            return None, "stale_epoch"
        if now > entry.lease.deadline:
            return None, "expired"
        return entry, None

    def check_frame(self, frame: KvLayer, now: float | None = None) -> str | None:
        """None when the frame may be written; else the reason to drop it."""
        entry, reason = self._check(frame.request_id, frame.lease_epoch, now or time.time())
        if entry is None:
            return reason
        if not 0 <= frame.layer < self.num_layers:
            return "bad_layer"
        if not frame.block_ids or not set(frame.block_ids) <= set(entry.lease.block_ids):
            return "blocks_not_leased"
        return None

    def mark_layer(self, frame: KvLayer) -> None:
        self._active[frame.request_id].covered.setdefault(frame.layer, set()).update(frame.block_ids)

    def check_done(self, done: KvDone, now: float | None = None) -> str | None:
        entry, reason = self._check(done.request_id, done.lease_epoch, now or time.time())
        if entry is None:
            return reason
        if done.num_layers != self.num_layers:
            return "layer_count"
        want = set(entry.lease.block_ids)
        if any(entry.covered.get(layer) != want for layer in range(self.num_layers)):
            return "incomplete"
        return None

    def release(self, request_id: str) -> Lease:
        """Transfer complete: the blocks now belong to the admitted sequence."""
        return self._active.pop(request_id).lease

    def revoke(self, request_id: str) -> bool:
        entry = self._active.pop(request_id, None)
        if entry is None:
            return False
        self._quarantine.append((entry.lease.deadline, entry.lease.block_ids))
        return True

    def expire(self, now: float | None = None) -> list[str]:
        """Revoke leases past their deadline; returns their request ids."""
        now = now or time.time()
        gone = [rid for rid, e in self._active.items() if now > e.lease.deadline]
        for rid in gone:
            self.revoke(rid)
        return gone

    def reclaimable(self, now: float | None = None) -> list[int]:
        """Quarantined blocks whose deadline has passed (removed from the quarantine)."""
        now = now or time.time()
        ready = [blocks for deadline, blocks in self._quarantine if now > deadline]
        self._quarantine = [(d, b) for d, b in self._quarantine if now <= d]
        return [b for blocks in ready for b in blocks]
