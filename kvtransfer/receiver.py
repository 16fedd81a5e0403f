"""Decode side of KV transfer: verify every frame against its lease, then land it in the pool.

Frames arrive on one PULL socket per decode worker (kvtransfer/wire.py), in order per prefill
worker: a request's layer frames, then its KvDone. A layer frame is written only if it is
authenticated, decodes, its lease is active (request, epoch, deadline, blocks, layer, fresh seq:
LeaseTable.check_frame), its dtype, head range, shape and byte count match this pool and the
payload, and (with `payload_mac=True`) the payload's HMAC tag in the header matches its bytes.
The received ZMQ frame is the staging buffer: private to this process, verified in full, then
copied once into `kv_cache[layer][:, blocks]`; a frame failing any check never touches a block.
In-place (shared-memory) headers only mark the layer: P already wrote it (under tensor
parallelism, into every rank pool holding its heads: they are all advertised, `ShmPool`). Layers past the
target's (L ..) are a draft model's (`draft_kv_cache`, same block ids). A KvDone is returned
by `poll` only when LeaseTable.check_done passes (all layers of all leased blocks, same epoch).
A frame may carry some of the KV heads only (`kv_head_start/end`: a tensor-parallel prefill
worker sends one per rank); its heads are written into every rank pool holding them, and the
lease's byte count (KvDone's `kv_bytes`) tells a missing head range. Prefill ranks sending on
streams of their own each end theirs with a KvRangeDone; a KvDone naming `range_dones` of them
is held (not dropped) until they are all in, then checked: bytes of all streams together.
Everything else is dropped and counted in `dropped[reason]`; the receiver never raises on input.
A KvDone refused for a lease that is still active (a frame went missing: "incomplete",
"bytes_mismatch", "layer_count", "expired") is also put in `failed_done` for the owner: it is
P's last message for that lease, so the owner can end the request and reclaim the blocks now
instead of waiting for the lease deadline.
"""

from __future__ import annotations

import collections
import logging
import warnings

import torch
import zmq

from pdserve.kvtransfer.head_ranges import HeadShard, head_span, overlaps
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.sender import copy_blocks
from pdserve.kvtransfer.wire import KvFrameHeader, decode_kv, dtype_name
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.channel import Inbox
from pdserve.protocol.messages import KvDone, KvRangeDone, KvRelease, KvRenew, Lease

log = logging.getLogger(__name__)

# check_done reasons meaning "P is done with this lease, but its KV did not all land"
_DONE_FAILURES = frozenset({"incomplete", "bytes_mismatch", "layer_count", "expired"})


class KvReceiver:
    def __init__(
        self,
        ctx: zmq.Context,
        auth: FrameAuth,
        bind_addr: str,
        kv_cache: torch.Tensor,
        lease_table: LeaseTable,
        *,
        allow_wildcard: bool = False,
        kv_head_start: int = 0,
        allow_in_place: bool = True,
        payload_mac: bool = False,
        rank_pools: list[HeadShard] | None = None,
        draft_kv_cache: torch.Tensor | None = None,
    ) -> None:
        """`rank_pools`: a tensor-parallel worker's pools, one per rank with its KV heads (rank 0's
        is `kv_cache`); each frame's head range is written into every pool holding those heads.
        `draft_kv_cache`: a draft model's pool [Ld, 2, N, bs, Hkv', D'] (same block ids); frames
        for layers L .. L + Ld - 1 land there (always as payloads, never in place)."""
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise ValueError(f"kv_cache must be [L, 2, N, bs, Hkv, D], got {list(kv_cache.shape)}")
        draft_layers = draft_kv_cache.shape[0] if draft_kv_cache is not None else 0
        if (kv_cache.shape[0], draft_layers) != (lease_table.num_layers, lease_table.draft_layers):
            raise ValueError("kv_cache and lease table disagree on the number of layers")
        self.shards = rank_pools or [HeadShard(kv_head_start, kv_head_start + kv_cache.shape[4], kv_cache)]
        if any(s.pool.shape[:4] != kv_cache.shape[:4] or s.pool.shape[5:] != kv_cache.shape[5:] for s in self.shards):
            raise ValueError("rank pools disagree with kv_cache on layers, blocks or head size")
        self.heads = head_span(self.shards)  # [first, last) KV head a frame may carry
        self.inbox = Inbox(ctx, auth, bind_addr, allow_wildcard, decoder=decode_kv)
        self.kv_cache = kv_cache  # [L, 2, N, bs, Hkv, D]
        self.draft_shards = (  # the draft's pool, all its heads (a draft is never tensor-parallel)
            [HeadShard(0, draft_kv_cache.shape[4], draft_kv_cache)] if draft_kv_cache is not None else []
        )
        self.leases = lease_table
        self.allow_in_place = allow_in_place
        self.payload_mac = payload_mac  # require and check each payload's HMAC tag
        self._auth = auth
        self._dtype = dtype_name(kv_cache.dtype)
        self.bytes_received = 0
        self.released: list[int] = []  # blocks of leases P released early; the owner frees them
        self.failed_done: list[tuple[KvDone, str]] = []  # refused KvDone of active leases; the owner drains it
        self.renewed: list[tuple[str, Lease]] = []  # (request id, lease) moved by KvRenew; the owner reports them
        self.frames_received = 0
        # KvDone held until the KvRangeDone of every other prefill rank's stream is in
        self._waiting: dict[tuple[str, int], KvDone] = {}
        self.dropped: collections.Counter[str] = self.inbox.dropped  # auth/decode + lease/layout reasons

    @property
    def addr(self) -> str:
        return self.inbox.addr

    @property
    def socket(self) -> zmq.Socket:
        return self.inbox.socket

    def poll(self, timeout_ms: int | None = 0, max_frames: int = 256) -> list[KvDone]:
        """Drain what has arrived (waiting up to timeout_ms for the first message, at most
        max_frames per call so a busy stream cannot starve the decode loop); returns the requests
        whose KV is complete and verified, in arrival order."""
        done: list[KvDone] = []
        for _ in range(max_frames):
            parsed = self.inbox.recv_raw(timeout_ms)
            if parsed is None:
                break
            timeout_ms = 0
            msg, payloads = parsed
            try:
                if isinstance(msg, KvFrameHeader):
                    reason = self._accept_layer(msg, payloads)
                elif isinstance(msg, KvDone):
                    reason = "unexpected_payload" if payloads else self._on_done(msg, done)
                elif isinstance(msg, KvRangeDone):
                    reason = "unexpected_payload" if payloads else self.leases.mark_range_done(msg)
                    waiting = self._waiting.pop((msg.request_id, msg.lease_epoch), None)
                    if waiting is not None:  # rank 0's KvDone came first: check it again
                        why = self._on_done(waiting, done)
                        if why is not None:
                            self.inbox.drop(why, f"KvDone for {waiting.request_id!r}")
                elif isinstance(msg, KvRelease):
                    self.released.extend(self.leases.release_early(msg.request_id, msg.lease_epoch))
                    reason = None
                elif isinstance(msg, KvRenew):
                    lease = self.leases.renew(msg.request_id, msg.lease_epoch)
                    if lease is not None:
                        self.renewed.append((msg.request_id, lease))
                    reason = None  # too late to renew: the lease's own end is reported already
                else:  # pragma: no cover - the decoder admits only the two kinds
                    reason = "unexpected_message"
            except Exception:  # never let one frame take the decode worker down
                log.exception("error handling a KV frame")
                reason = "internal_error"
            if reason is not None:
                self.inbox.drop(reason, f"{type(msg).__name__} for {msg.request_id!r}")
        return done

    def _on_done(self, msg: KvDone, done: list[KvDone]) -> str | None:
        """Admit, fail, hold (other ranks' streams not all done) or drop a KvDone; the drop reason."""
        reason = self.leases.check_done(msg)
        if reason is None and not self._every_head(self.leases.heads_written(msg.request_id)):
            reason = "incomplete"  # a head range no frame carried (its bytes not counted either)
        if reason is None:
            done.append(msg)
        elif reason == "waiting":
            self._waiting = {k: d for k, d in self._waiting.items() if self.leases.get(k[0]) is not None}
            self._waiting[(msg.request_id, msg.lease_epoch)] = msg
            return None
        elif reason in _DONE_FAILURES:
            self.failed_done.append((msg, reason))
        elif reason == "unknown_lease":
            # Revoked (aborted) before its KV completed. KvDone is P's last message for
            # the lease, as good as a release: the quarantined blocks are safe now.
            blocks = self.leases.release_early(msg.request_id, msg.lease_epoch)
            if blocks:
                self.released.extend(blocks)
                return None
        return reason

    def _every_head(self, ranges: set[tuple[int, int]]) -> bool:
        """Whether frames' head ranges cover every KV head of this worker (or name none: an
        old-style (0, 0) range)."""
        heads = set().union(*(range(s, e) for s, e in ranges))
        return not heads or heads >= set(range(*self.heads))

    def _accept_layer(self, h: KvFrameHeader, payloads: list[memoryview]) -> str | None:
        reason = self.leases.check_frame(h)
        if reason is not None:
            return reason
        shards, layer, (lo, hi) = self.shards, h.layer, self.heads
        if layer >= self.leases.num_layers:  # a draft model's layer (the lease table checked the range)
            shards, layer = self.draft_shards, layer - self.leases.num_layers
            lo, hi = 0, shards[0].end
            if h.in_place:
                return "in_place_not_allowed"
        if h.dtype != self._dtype or not lo <= h.kv_head_start < h.kv_head_end <= hi:
            return "layout_mismatch"
        pool = shards[0].pool  # [L, 2, N, bs, h, D]
        n, heads = len(h.block_ids), h.kv_head_end - h.kv_head_start
        head_bytes = 2 * pool.shape[3] * pool.shape[5] * pool.element_size()  # K+V, one block, one head
        if h.shape != [2, n, pool.shape[3], heads, pool.shape[5]] or h.nbytes != n * heads * head_bytes:
            return "size_mismatch"
        if h.in_place:  # P wrote these heads into every rank pool holding them (ShmKvSender)
            if not self.allow_in_place:
                return "in_place_not_allowed"
            if payloads:
                return "unexpected_payload"
        else:
            if len(payloads) != 1 or payloads[0].nbytes != h.nbytes:
                return "size_mismatch"
            if self.payload_mac and h.payload_mac is None:
                return "payload_mac_missing"
            if self.payload_mac and not self._auth.check_payload_mac(h.payload_mac, payloads[0]):
                return "payload_mac"
            with warnings.catch_warnings():  # read-only ZMQ buffer: we only read from it
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(payloads[0], dtype=torch.uint8)
            data = data.view(pool.dtype).view(h.shape)  # [2, n, bs, heads, D]
            for o in overlaps(h.kv_head_start, h.kv_head_end, shards):
                dst = o.shard.pool[layer][:, :, :, o.dst : o.dst + o.count]  # [2, N, bs, count, D]
                copy_blocks(dst, h.block_ids, data[:, :, :, o.src : o.src + o.count], list(range(n)))
        self.leases.mark_frame(h)
        self.bytes_received += h.nbytes
        self.frames_received += 1
        return None

    def close(self) -> None:
        self.inbox.close()

    def __enter__(self) -> "KvReceiver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
