"""Decode-side KV leases: who may write which blocks, fenced by epoch and deadline.

    grant --> active --complete + release--> blocks belong to the admitted sequence
               |  \\--revoke (abort) / expire (deadline passed)--> quarantine --deadline+grace--> reclaimable
               +--renew (P still holds it: queued or computing)--> active, deadline = now + ttl

Rules (D's view; every check returns None when fine, else a short reason string):
- Epochs start at a random 62-bit value per process and only grow, so a frame carrying an
  epoch from an earlier lease for the same request id, or from a previous run of this process,
  never matches an active lease ("stale_epoch").
- A frame is accepted only while its lease is active and not past its deadline, for a layer in
  range, for blocks that are all (and distinctly) the lease's, with a sequence number larger
  than any accepted before for this lease (replays and reordering are "duplicate").
- Sequence numbers are per head range: a tensor-parallel prefill worker's ranks each send their
  own heads on their own stream (rank 0 may send several ranges on one; each stays in order).
- A request completes when every layer has been written for every leased block. Once completed
  (released) or revoked the lease is gone: anything later for it is "unknown_lease". When P's
  ranks send on streams of their own, rank 0's KvDone names how many other streams' KvRangeDone
  markers (each after its rank's last frame, FIFO per stream) must be in first ("waiting"
  until then), and the bytes of all streams together must be those that arrived.

Prefix blocks: a lease may also carry `prefix_block_ids`, blocks D already holds for the
prompt's leading blocks (its prefix cache, pinned at grant). No frame may write them; admission
takes them first; a lease that ends any other way gives them back at once (nobody writes them,
so nothing to fence).

Renewal: a prefill worker may hold a request queued behind others for longer than a lease
lives (a burst on a real-sized model). While it does, it sends `KvRenew` on the FIFO KV stream
and D moves the deadline of the still-active lease to now + ttl (never earlier). P uses a new
deadline only once D's `LeaseRenewed` reaches it, so P's deadline is never later than D's; a
lease that expired or was revoked first stays ended (renew returns None), and a dead or stuck P
stops renewing, so its leases still run out.

Quarantine, and why: the zmq transport is safe by construction (D itself checks the lease before
copying), but the shared-memory transport lets P write into D's pool directly, with no check on
D's side at write time. P checks the lease deadline before each layer write and refuses after it.
So until the deadline a P that has not heard of an abort may still be writing those blocks;
if D handed them to another request at once, that late write would corrupt it. Hence a revoked
or expired lease's blocks come back from `reclaimable()` only after the deadline plus a small
grace (a write that started just before the deadline may still be finishing). Same host for shm,
so P and D read the same clock (time.time(), unix seconds).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from pdserve.protocol.messages import KvDone, KvRangeDone, Lease

QUARANTINE_GRACE_S = 1.0


def _head_range(header) -> tuple[int, int]:
    """The KV heads a frame carries: its sender's (a prefill rank's) key for sequence numbers."""
    return getattr(header, "kv_head_start", 0), getattr(header, "kv_head_end", 0)


@dataclass
class _Active:
    lease: Lease
    block_set: frozenset[int]
    # layer -> head range -> blocks written (each range its own sender: a prefill rank)
    covered: dict[int, dict[tuple[int, int], set[int]]] = field(default_factory=dict)
    last_seq: dict[tuple[int, int], int] = field(default_factory=dict)  # per head range (one sender each)
    nbytes: int = 0
    range_bytes: dict[tuple[int, int], int] = field(default_factory=dict)  # KvRangeDone: head range -> bytes


class LeaseTable:
    def __init__(
        self,
        num_layers: int,
        *,
        grace_s: float = QUARANTINE_GRACE_S,
        clock: Callable[[], float] = time.time,
        draft_layers: int = 0,
    ) -> None:
        """`draft_layers`: a draft model's layers a transfer may carry after the `num_layers`
        (layers num_layers .. num_layers + draft_layers - 1); a transfer is complete with all of
        the target's layers, or all of both when its KvDone counts them."""
        if num_layers <= 0 or draft_layers < 0:
            raise ValueError("num_layers must be positive (draft_layers >= 0)")
        self.num_layers = num_layers
        self.draft_layers = draft_layers
        self.grace_s = grace_s
        self._clock = clock
        self._next_epoch = secrets.randbits(62)
        self._active: dict[str, _Active] = {}
        self.num_renewals = 0
        # (reclaimable after, blocks, request id, epoch)
        self._quarantine: list[tuple[float, list[int], str, int]] = []
        self._unpinned: list[int] = []  # prefix blocks of revoked leases, for the next reclaimable()

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    # --- granting ---------------------------------------------------------------------------
    def grant(self, request_id: str, block_ids: list[int], ttl_s: float, prefix_block_ids: Sequence[int] = ()) -> Lease:
        """A lease on `block_ids` for the writer. `prefix_block_ids`: blocks already holding the
        prompt's leading KV (pinned by the caller), never written under the lease; they are the
        table's too until admission, and come back at once when the lease ends any other way."""
        if request_id in self._active:
            raise ValueError(f"a lease for {request_id!r} is active")
        blocks = [int(b) for b in block_ids]
        prefix = [int(b) for b in prefix_block_ids]
        every = blocks + prefix
        if not blocks or len(set(every)) != len(every) or min(every) < 0:
            raise ValueError("a lease needs distinct, non-negative block ids")
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self._next_epoch += 1
        lease = Lease(
            epoch=self._next_epoch,
            block_ids=blocks,
            deadline=self._clock() + ttl_s,
            ttl_s=ttl_s,
            prefix_block_ids=prefix,
        )
        self._active[request_id] = _Active(lease, frozenset(blocks))
        return lease

    def renew(self, request_id: str, epoch: int, now: float | None = None) -> Lease | None:
        """Extend an active, unexpired lease of this epoch to now + its ttl; the renewed Lease,
        or None when there is nothing to renew (ended, expired, another epoch)."""
        now = self._now(now)
        entry, _ = self._entry(request_id, epoch, now)
        if entry is None:
            return None
        lease = entry.lease
        entry.lease = msgspec.structs.replace(lease, deadline=max(lease.deadline, now + lease.ttl_s))
        self.num_renewals += 1
        return entry.lease

    def get(self, request_id: str) -> Lease | None:
        entry = self._active.get(request_id)
        return entry.lease if entry else None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._active

    @property
    def num_active(self) -> int:
        return len(self._active)

    @property
    def num_quarantined_blocks(self) -> int:
        return sum(len(q[1]) for q in self._quarantine)

    # --- checking writes --------------------------------------------------------------------
    def _entry(self, request_id: str, epoch: int, now: float) -> tuple[_Active | None, str | None]:
        entry = self._active.get(request_id)
        if entry is None:
            return None, "unknown_lease"
        if entry.lease.epoch != epoch:
            return None, "stale_epoch"
        if now > entry.lease.deadline:
            return None, "expired"
        return entry, None

    def check_frame(self, header, now: float | None = None) -> str | None:
        """`header`: anything with request_id, lease_epoch, layer, block_ids and (optionally) seq
        (kvtransfer.wire.KvFrameHeader). None when it may be written, else the reason to drop it."""
        entry, reason = self._entry(header.request_id, header.lease_epoch, self._now(now))
        if entry is None:
            return reason
        if not 0 <= header.layer < self.num_layers + self.draft_layers:
            return "bad_layer"
        blocks = header.block_ids
        if not blocks or len(set(blocks)) != len(blocks) or not entry.block_set.issuperset(blocks):
            return "blocks_not_leased"
        seq = getattr(header, "seq", None)
        if seq is not None and seq <= entry.last_seq.get(_head_range(header), -1):
            return "duplicate"
        return None

    def mark_layer(
        self,
        request_id: str,
        layer: int,
        block_ids: list[int] | None = None,
        *,
        seq: int | None = None,
        nbytes: int = 0,
        heads: tuple[int, int] = (0, 0),
    ) -> None:
        """Record that `layer` was written for `block_ids` (default: all the lease's blocks);
        `seq` numbers the frames of head range `heads` (each range has one sender)."""
        entry = self._active[request_id]
        written = entry.covered.setdefault(layer, {}).setdefault(heads, set())
        written.update(entry.block_set if block_ids is None else block_ids)
        if seq is not None:
            entry.last_seq[heads] = max(entry.last_seq.get(heads, -1), seq)
        entry.nbytes += nbytes

    def mark_frame(self, header) -> None:
        self.mark_layer(
            header.request_id,
            header.layer,
            header.block_ids,
            seq=getattr(header, "seq", None),
            nbytes=getattr(header, "nbytes", 0),
            heads=_head_range(header),
        )

    def mark_range_done(self, done: KvRangeDone, now: float | None = None) -> str | None:
        """A prefill rank's stream sent all its frames (its KvRangeDone); None when recorded."""
        entry, reason = self._entry(done.request_id, done.lease_epoch, self._now(now))
        if entry is None:
            return reason
        key = (done.kv_head_start, done.kv_head_end)
        if key in entry.range_bytes:
            return "duplicate"
        entry.range_bytes[key] = done.kv_bytes
        return None

    def complete(self, request_id: str, epoch: int, num_layers: int, now: float | None = None) -> str | None:
        """None when every layer of every leased block has been written under this epoch, by
        every head range that wrote any of the target's layers (draft layers: of the draft's)."""
        entry, reason = self._entry(request_id, epoch, self._now(now))
        if entry is None:
            return reason
        if num_layers != self.num_layers and (
            not self.draft_layers or num_layers != self.num_layers + self.draft_layers
        ):
            return "layer_count"
        if len(entry.covered) != num_layers:
            return "incomplete"
        target, draft = (
            self._ranges(entry, layers) for layers in (range(self.num_layers), range(self.num_layers, num_layers))
        )
        for layer in range(num_layers):
            written = entry.covered[layer]
            if any(
                len(written.get(r, ())) != len(entry.block_set) for r in (target if layer < self.num_layers else draft)
            ):
                return "incomplete"
        return None

    @staticmethod
    def _ranges(entry: _Active, layers: range) -> set[tuple[int, int]]:
        return {r for layer in layers for r in entry.covered.get(layer, {})}

    def heads_written(self, request_id: str) -> set[tuple[int, int]]:
        """The head ranges frames of the target's layers carried for this request's lease."""
        entry = self._active.get(request_id)
        return self._ranges(entry, range(self.num_layers)) if entry is not None else set()

    def check_done(self, done: KvDone, now: float | None = None) -> str | None:
        """`complete` for a KvDone, plus its byte count when P reports one. "waiting": the KvDone
        names `range_dones` other streams (prefill ranks) not all heard from yet; check again
        once they are (their frames may still be on the way). Then the bytes of every stream
        together must be what arrived."""
        entry, reason = self._entry(done.request_id, done.lease_epoch, self._now(now))
        if entry is not None and len(entry.range_bytes) < done.range_dones:
            return "waiting"
        reason = reason or self.complete(done.request_id, done.lease_epoch, done.num_layers, now)
        if reason is None and done.kv_bytes:
            assert entry is not None
            if done.kv_bytes + sum(entry.range_bytes.values()) != entry.nbytes:
                return "bytes_mismatch"
        return reason

    # --- ending -----------------------------------------------------------------------------
    def release(self, request_id: str) -> Lease:
        """Transfer complete: the blocks (prefix ones first) now belong to the admitted sequence."""
        return self._active.pop(request_id).lease

    def revoke(self, request_id: str) -> bool:
        """Abort: the lease ends now, its blocks are quarantined until deadline + grace."""
        entry = self._active.pop(request_id, None)
        if entry is None:
            return False
        self._quarantine.append(
            (entry.lease.deadline + self.grace_s, list(entry.lease.block_ids), request_id, entry.lease.epoch)
        )
        self._unpinned.extend(entry.lease.prefix_block_ids)  # never writable: free at the next reclaim
        return True

    def abort(self, request_id: str, *, writer_gone: bool) -> list[int]:
        """The request ended before its KV was handed over; returns the blocks free now.
        `writer_gone` (the gateway knows no prefill worker holds, or will ever hold, this lease):
        its blocks, active or quarantined, are safe at once. Else an active lease is revoked and
        its blocks wait out the deadline in quarantine (returned later by `reclaimable`)."""
        if not writer_gone:
            self.revoke(request_id)
            return []
        entry = self._active.pop(request_id, None)
        if entry is not None:
            return list(entry.lease.block_ids) + list(entry.lease.prefix_block_ids)
        for i, (_, blocks, rid, _) in enumerate(self._quarantine):
            if rid == request_id:
                del self._quarantine[i]
                return blocks
        return []

    def release_early(self, request_id: str, epoch: int) -> list[int]:
        """The writer (P) promises, on the FIFO KV stream, never to write this lease again: its
        blocks are safe to reuse now, whether the lease is still active or quarantined."""
        entry = self._active.get(request_id)
        if entry is not None and entry.lease.epoch == epoch:
            del self._active[request_id]
            return list(entry.lease.block_ids) + list(entry.lease.prefix_block_ids)
        for i, (_, blocks, rid, ep) in enumerate(self._quarantine):
            if rid == request_id and ep == epoch:
                del self._quarantine[i]
                return blocks
        return []

    def expired(self, now: float | None = None) -> list[str]:
        """Request ids whose active lease is past its deadline (nothing changes)."""
        now = self._now(now)
        return [rid for rid, e in self._active.items() if now > e.lease.deadline]

    def expire(self, now: float | None = None) -> list[str]:
        """Revoke every lease past its deadline; returns their request ids."""
        gone = self.expired(now)
        for rid in gone:
            self.revoke(rid)
        return gone

    def reclaimable(self, now: float | None = None) -> list[int]:
        """Quarantined blocks now safe to reuse (removed from the quarantine; each returned once)."""
        now = self._now(now)
        ready = [q[1] for q in self._quarantine if now > q[0]]
        if ready:
            self._quarantine = [q for q in self._quarantine if now <= q[0]]
        unpinned, self._unpinned = self._unpinned, []
        return unpinned + [b for blocks in ready for b in blocks]
