"""Prefill side of KV transfer: ship one layer's blocks of a request to its decode worker.

    ZmqKvSender  gather the blocks into one contiguous staging buffer (the only copy on P) and
                 send it zero-copy as `[mac, KvFrameHeader, payload]` over tcp:// or ipc://; a
                 buffer is reused only after ZMQ reports it sent (MessageTracker), so the source
                 pool may change right after send_layer returns. A layer bigger than
                 `max_frame_bytes` goes as several frames, each for some of its blocks.
                 With `payload_mac=True` the staging buffer is MACed after the gather and the
                 tag travels in the header (kvtransfer/wire.py), so D can authenticate the bytes.
    ShmKvSender  map D's shared KV pool [L, 2, N, bs, Hkv, D] once (a tensor-parallel D: each
                 rank's pool, with its heads), write the blocks in place (one copy, straight
                 into D's leased blocks of every rank pool holding those heads), then send only
                 the header (`in_place=True`) so D can account for the layer. A draft model's
                 layers (numbered L ..; D's draft pool is not shared) go as payload frames.
Both then send `KvDone` on the same stream; ZMQ keeps one sender's messages in order.
A tensor-parallel prefill worker calls `send_layer` once per distinct rank pool, each with its
`kv_head_start`; frames name their head range, and D writes it into the rank pools that hold
those heads (kvtransfer/head_ranges.py).

Refusals raise `KvTransferError` subclasses; the caller (prefill worker) should catch them,
stop transferring for that request and report it:
    LeaseExpired  the lease deadline has passed (shm: or is within SHM_DEADLINE_MARGIN_S). After
                  the deadline D may have reassigned the blocks (see kvtransfer/lease.py).
    KvSendError   D's queue stayed full for `send_timeout_ms` (D stuck or gone).
Wrong arguments (block counts, shapes, blocks outside the lease or the pool) raise ValueError.
A sender is not thread-safe: one per destination, used from the forward-pass thread.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch
import zmq

from pdserve.kvtransfer.head_ranges import HeadShard, head_span, overlaps
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.kvtransfer.wire import KvFrameHeader, dtype_name, torch_dtype
from pdserve.protocol import kv_rows
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.channel import Outbox
from pdserve.protocol.messages import KvDone, KvLayout, KvRangeDone, KvRelease, KvRenew, Lease, ShmPool

log = logging.getLogger(__name__)

KV_SNDHWM = 256  # KV messages queued per destination (layer frames are MBs each)
SEND_TIMEOUT_MS = 5_000  # how long a layer send may wait for room before KvSendError
SHM_DEADLINE_MARGIN_S = 0.1  # shm writers stop this long before the deadline (D adds a grace after)
_MAX_TRACKED_REQUESTS = 4096
STAGING_RING = 8  # zmq: staging buffers (= frames in flight) per destination
MAX_FRAME_BYTES = 16 << 20  # zmq: a layer larger than this goes as several frames (bounds message size)

__all__ = [
    "KvSender",
    "ZmqKvSender",
    "ShmKvSender",
    "make_kv_sender",
    "copy_blocks",
    "torch_dtype",
    "KvTransferError",
    "LeaseExpired",
    "KvSendError",
]


class KvTransferError(RuntimeError):
    pass


class LeaseExpired(KvTransferError):
    pass


class KvSendError(KvTransferError):
    pass


def _runs(src_ids: list[int], dst_ids: list[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) runs where both id lists advance by one."""
    runs: list[tuple[int, int, int]] = []
    s0, d0, k = src_ids[0], dst_ids[0], 1
    for s, d in zip(src_ids[1:], dst_ids[1:]):
        if s == s0 + k and d == d0 + k:
            k += 1
        else:
            runs.append((s0, d0, k))
            s0, d0, k = s, d, 1
    runs.append((s0, d0, k))
    return runs


def _few(runs: list, n: int) -> bool:
    return len(runs) == 1 or len(runs) * 4 <= n  # runs of 4+ blocks: slice copies beat index kernels


def _memmove(dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


_contiguous_copy: Callable[[int, int, int], None] = _memmove


def use_contiguous_copy(copy: Callable[[int, int, int], None]) -> None:
    """How this process copies `nbytes` of contiguous CPU memory (`copy(dst_addr, src_addr,
    nbytes)`); ctypes.memmove until set. Workers and the KV benchmarks set kernels/stream_copy.py's
    streaming-store copy (pdserve/worker_process.py: kvtransfer/ does not import kernels/): a
    pool's blocks written by a transfer are not read again soon (P never reads them; D when it
    decodes the request)."""
    global _contiguous_copy
    _contiguous_copy = copy


def _copy_piece(dst: torch.Tensor, src: torch.Tensor, streaming: bool) -> None:
    """dst[:] = src: contiguous CPU pieces of one dtype through the installed copy when
    `streaming`, else torch's copy."""
    if (
        streaming
        and dst.device.type == "cpu"
        and src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.is_contiguous()
        and src.is_contiguous()
    ):
        _contiguous_copy(dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size())
    else:
        dst.copy_(src)


def _copy_run(dst: torch.Tensor, src: torch.Tensor, streaming: bool) -> None:
    """dst[:] = src for a run of blocks [2, k, bs, Hkv, D]: in one piece, or K and V apart (each
    contiguous when the run holds every head), else torch's strided copy. `streaming`: contiguous
    pieces through the installed copy (for destinations not read again soon)."""
    if dst.is_contiguous() and src.is_contiguous():
        _copy_piece(dst, src, streaming)
        return
    for half in range(dst.shape[0]):
        _copy_piece(dst[half], src[half], streaming)


def _copy_runs_flat(pool: torch.Tensor, layer: int, src_layer: torch.Tensor, runs: list[tuple[int, int, int]]) -> None:
    """pool[layer][:, d0 : d0 + k] = src_layer[:, s0 : s0 + k] for each run, K and V apart, by
    address: no torch call per piece (each would let the worker's other lane take the GIL). For a
    contiguous CPU pool holding exactly the source's heads and a contiguous CPU source.
    pool [L, 2, N, bs, H, D]; src_layer [2, N_src, bs, H, D]."""
    n_dst, n_src = pool.shape[2], src_layer.shape[1]
    block = math.prod(src_layer.shape[2:]) * src_layer.element_size()  # bytes of one block's K (or V)
    dst0 = pool.data_ptr() + layer * 2 * n_dst * block
    src0 = src_layer.data_ptr()
    for s0, d0, k in runs:
        for half in (0, 1):
            _contiguous_copy(dst0 + (half * n_dst + d0) * block, src0 + (half * n_src + s0) * block, k * block)


def copy_blocks(
    dst_layer: torch.Tensor, dst_ids: list[int], src_layer: torch.Tensor, src_ids: list[int], streaming: bool = True
) -> None:
    """dst_layer[:, dst_ids] = src_layer[:, src_ids] for [2, N, bs, Hkv, D] layers, in one pass
    where possible: slice copies over runs of consecutive ids on both sides (fresh pools); else a
    gather of the source (if scattered) and slice copies over the destination's runs, or one
    index_copy_ of block rows when the destination is scattered too. `streaming` (a pool's blocks):
    runs through the copy `use_contiguous_copy` installed; off for a buffer read next."""
    n = len(dst_ids)
    runs = _runs(src_ids, dst_ids)
    if _few(runs, n):
        for s0, d0, k in runs:
            _copy_run(dst_layer[:, d0 : d0 + k], src_layer[:, s0 : s0 + k], streaming)
        return
    dev_d, dev_s = dst_layer.device, src_layer.device
    n_dst, n_src = dst_layer.shape[1], src_layer.shape[1]
    if n_src == n and src_ids == list(range(n)):
        source = src_layer  # the whole source in order (a received payload)
    else:
        source = src_layer.index_select(1, torch.as_tensor(src_ids, dtype=torch.long, device=dev_s))
    dst_runs = _runs(list(range(n)), dst_ids)
    if _few(dst_runs, n):
        for p0, d0, k in dst_runs:
            _copy_run(dst_layer[:, d0 : d0 + k], source[:, p0 : p0 + k], streaming)
        return
    source = source.to(dev_d)
    if dst_layer.is_contiguous() and source.is_contiguous():
        # rows of one block's K or V: [2 * N, bs * Hkv * D]; row of (kv, block) = kv * N + block
        idx = torch.as_tensor(dst_ids + [b + n_dst for b in dst_ids], dtype=torch.long, device=dev_d)
        dst_layer.view(2 * n_dst, -1).index_copy_(0, idx, source.reshape(2 * n, -1))
    else:
        dst_layer.index_copy_(1, torch.as_tensor(dst_ids, dtype=torch.long, device=dev_d), source)


class KvSender(ABC):
    """Owned by a prefill worker, one per destination; called from the forward pass."""

    transport = "?"
    ctx: zmq.Context  # the context its outbox lives in

    def __init__(self, outbox: Outbox, *, send_timeout_ms: int = SEND_TIMEOUT_MS) -> None:
        self.outbox = outbox
        self.send_timeout_ms = send_timeout_ms
        self._seq: collections.OrderedDict[tuple[str, int], int] = collections.OrderedDict()
        self._closed = False
        self.bytes_sent = 0

    @property
    def closed(self) -> bool:
        return self._closed

    @abstractmethod
    def send_layer(
        self,
        request_id: str,
        lease: Lease | int,
        layer: int,
        src_kv_layer: torch.Tensor,
        src_block_ids: list[int],
        dst_block_ids: list[int],
        *,
        deadline: float | None = None,
        kv_head_start: int = 0,
    ) -> int:
        """Ship `src_kv_layer[:, src_block_ids]` ([2, N, bs, Hkv, D]) into D's `dst_block_ids`
        of `layer`; returns the bytes moved. `lease`: the Lease (preferred: its deadline and block
        ids are checked here too) or just its epoch, with `deadline=` when known.
        `kv_head_start`: the model's first KV head in `src_kv_layer` (a tensor-parallel rank's
        pool holds heads [kv_head_start, kv_head_start + Hkv); kvtransfer/head_ranges.py)."""

    def send_done(self, done: KvDone) -> bool:
        """Queue the request's KvDone (after its last layer); False when D's queue stayed full."""
        self._forget(done.request_id, done.lease_epoch)
        ok = self.outbox.send(done, timeout_ms=self.send_timeout_ms)
        if not ok:
            log.error("KvDone for %s not sent: queue to %s full", done.request_id, self.outbox.addr)
        return ok

    def send_range_done(self, request_id: str, lease_epoch: int, heads: tuple[int, int], kv_bytes: int) -> bool:
        """A prefill rank's stream (its own sender): every frame of KV heads `heads` for this lease
        is sent, `kv_bytes` in all (rank 0's KvDone names how many such markers D waits for)."""
        self._forget(request_id, lease_epoch)
        done = KvRangeDone(
            request_id=request_id,
            lease_epoch=lease_epoch,
            kv_head_start=heads[0],
            kv_head_end=heads[1],
            kv_bytes=kv_bytes,
        )
        return self.outbox.send(done, timeout_ms=self.send_timeout_ms)

    def send_release(self, request_id: str, lease_epoch: int) -> bool:
        """Tell D this lease will never be written again (after any frames already queued)."""
        self._forget(request_id, lease_epoch)
        return self.outbox.send(
            KvRelease(request_id=request_id, lease_epoch=lease_epoch), timeout_ms=self.send_timeout_ms
        )

    def send_renew(self, request_id: str, lease_epoch: int) -> bool:
        """Ask D to extend a lease this worker still holds; never blocks (a full queue: next time)."""
        return self.outbox.send(KvRenew(request_id=request_id, lease_epoch=lease_epoch), timeout_ms=0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.outbox.close()

    # --- shared steps -----------------------------------------------------------------------
    @staticmethod
    def _lease_terms(lease: Lease | int, deadline: float | None) -> tuple[int, float | None, list[int] | None]:
        if isinstance(lease, Lease):
            return lease.epoch, lease.deadline if deadline is None else min(deadline, lease.deadline), lease.block_ids
        return int(lease), deadline, None

    @staticmethod
    def _check_deadline(lease: Lease | float | None, margin_s: float = 0.0) -> None:
        deadline = lease.deadline if isinstance(lease, Lease) else lease
        if deadline is not None and time.time() + margin_s > deadline:
            raise LeaseExpired(f"lease deadline {deadline:.3f} passed (now {time.time():.3f}); not writing")

    @staticmethod
    def _check_args(
        src_kv_layer: torch.Tensor, src_ids: list[int], dst_ids: list[int], leased: list[int] | None
    ) -> None:
        if src_kv_layer.dim() != 5 or src_kv_layer.shape[0] != 2:
            raise ValueError(f"src_kv_layer must be [2, N, bs, Hkv, D], got {list(src_kv_layer.shape)}")
        if not dst_ids or len(src_ids) != len(dst_ids):
            raise ValueError(f"need as many source as destination blocks (got {len(src_ids)} and {len(dst_ids)})")
        n_src = src_kv_layer.shape[1]
        if min(src_ids) < 0 or max(src_ids) >= n_src:
            raise ValueError(f"source block ids outside [0, {n_src})")
        if len(set(dst_ids)) != len(dst_ids):
            raise ValueError("destination block ids repeat")
        if leased is not None and not set(dst_ids) <= set(leased):
            raise ValueError("destination blocks are not all the lease's")

    def _forget(self, request_id: str, epoch: int) -> None:
        """The lease is done with (KvDone, KvRangeDone or KvRelease sent): drop what is kept for it."""
        self._seq.pop((request_id, epoch), None)

    def _next_seq(self, request_id: str, epoch: int) -> int:
        key = (request_id, epoch)
        seq = self._seq.pop(key, -1) + 1
        self._seq[key] = seq
        while len(self._seq) > _MAX_TRACKED_REQUESTS:  # requests that never sent KvDone (aborted)
            self._seq.popitem(last=False)
        return seq

    def _send(self, header: KvFrameHeader, payloads: list) -> None:
        if self._closed:
            raise KvSendError("sender is closed")
        if not self.outbox.send(header, payloads, timeout_ms=self.send_timeout_ms):
            raise KvSendError(f"KV queue to {self.outbox.addr} stayed full for {self.send_timeout_ms} ms")
        self.bytes_sent += header.nbytes


class ZmqKvSender(KvSender):
    """Gathers each layer's blocks into a staging buffer and sends it zero-copy. Staging buffers
    come from a small ring and are reused only once ZMQ reports the previous frame in them sent
    (MessageTracker): no fresh multi-MB allocation (page faults) per layer, and at most
    `ring_size` frames in flight per destination (back-pressure instead of unbounded memory)."""

    transport = "zmq"

    def __init__(
        self,
        ctx: zmq.Context,
        auth: FrameAuth,
        kv_addr: str,
        *,
        send_timeout_ms: int = SEND_TIMEOUT_MS,
        sndhwm: int = KV_SNDHWM,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        ring_size: int = STAGING_RING,
        payload_mac: bool = False,
    ) -> None:
        self.ctx = ctx
        self.auth = auth
        self.payload_mac = payload_mac
        self.max_frame_bytes = max_frame_bytes
        self._ring: list[tuple[torch.Tensor | None, zmq.MessageTracker | None]] = [(None, None)] * max(1, ring_size)
        self._next_slot = 0
        super().__init__(Outbox(ctx, auth, kv_addr, sndhwm=sndhwm), send_timeout_ms=send_timeout_ms)

    def send_layer(
        self, request_id, lease, layer, src_kv_layer, src_block_ids, dst_block_ids, *, deadline=None, kv_head_start=0
    ) -> int:
        epoch, deadline, leased = self._lease_terms(lease, deadline)
        self._check_args(src_kv_layer, src_block_ids, dst_block_ids, leased)
        self._check_deadline(deadline)
        block_bytes = 2 * math.prod(src_kv_layer.shape[2:]) * src_kv_layer.element_size()
        per_frame = max(1, self.max_frame_bytes // block_bytes) if self.max_frame_bytes > 0 else len(dst_block_ids)
        sent = 0
        for i in range(0, len(dst_block_ids), per_frame):
            sent += self._send_blocks(
                request_id,
                epoch,
                layer,
                src_kv_layer,
                list(src_block_ids[i : i + per_frame]),
                list(dst_block_ids[i : i + per_frame]),
                kv_head_start,
            )
        return sent

    def _staging(self, dtype: torch.dtype, shape: tuple[int, ...], pinned: bool = False) -> tuple[torch.Tensor, int]:
        """A contiguous CPU tensor of `shape` on the next ring buffer whose last frame has gone
        (`pinned`: page-locked, for a GPU source)."""
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self._ring)
        buf, tracker = self._ring[slot]
        if tracker is not None and not tracker.done:
            try:
                tracker.wait(self.send_timeout_ms / 1000)
            except zmq.NotDone:
                raise KvSendError(
                    f"KV frames to {self.outbox.addr} not sent within {self.send_timeout_ms} ms"
                ) from None
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if buf is None or buf.numel() < nbytes or buf.is_pinned() != pinned:
            # grown on demand, then reused; page-locked when a GPU copies into it (DMA, no bounce)
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self._ring[slot] = (buf, None)
        return buf[:nbytes].view(dtype).view(shape), slot

    def _send_blocks(self, request_id, epoch, layer, src_kv_layer, src_ids, dst_ids, head_start) -> int:
        n = len(src_ids)
        data, slot = self._staging(src_kv_layer.dtype, (2, n, *src_kv_layer.shape[2:]), src_kv_layer.is_cuda)
        if src_kv_layer.device.type == "cpu" and not _few(_runs(src_ids, list(range(n))), n):
            torch.index_select(src_kv_layer, 1, torch.as_tensor(src_ids, dtype=torch.long), out=data)
        else:
            # slices (or a device gather); cached stores: ZeroMQ reads the staging buffer next
            copy_blocks(data, list(range(n)), src_kv_layer, src_ids, streaming=False)
        payload = data.reshape(-1).view(torch.uint8).numpy()  # any dtype (bf16 too) as raw bytes
        header = KvFrameHeader(
            request_id=request_id,
            lease_epoch=epoch,
            layer=layer,
            block_ids=dst_ids,
            kv_head_start=head_start,
            kv_head_end=head_start + data.shape[3],
            dtype=dtype_name(data.dtype),
            shape=list(data.shape),
            nbytes=data.nbytes,
            seq=self._next_seq(request_id, epoch),
            payload_mac=self.auth.payload_mac(payload) if self.payload_mac else None,
        )
        if self._closed:
            raise KvSendError("sender is closed")
        tracker = self.outbox.send_tracked(header, [payload], timeout_ms=self.send_timeout_ms)
        if tracker is None:
            raise KvSendError(f"KV queue to {self.outbox.addr} stayed full for {self.send_timeout_ms} ms")
        self._ring[slot] = (self._ring[slot][0], tracker)
        self.bytes_sent += header.nbytes
        return header.nbytes


class ShmKvSender(KvSender):
    """Writes each layer's blocks in place into D's shared pools: one pool with all its heads, or
    (a tensor-parallel D: `pools`, one per rank) each source head into every rank pool holding it,
    replicas included (kvtransfer/head_ranges.py `overlaps`); then one in-place header per call."""

    transport = "shm"

    def __init__(
        self,
        auth: FrameAuth,
        kv_addr: str,
        shm_name: str,
        layout: KvLayout,
        *,
        pools: list[ShmPool] | None = None,
        ctx: zmq.Context | None = None,
        send_timeout_ms: int = SEND_TIMEOUT_MS,
        sndhwm: int = KV_SNDHWM,
        deadline_margin_s: float = SHM_DEADLINE_MARGIN_S,
    ) -> None:
        self.ctx = ctx if ctx is not None else zmq.Context.instance()
        self.layout = layout
        self.deadline_margin_s = deadline_margin_s
        start = layout.kv_head_start
        pools = pools or [ShmPool(shm_name, start, start + layout.num_kv_heads)]
        self._mapped: list = []  # SharedTensor (or, CUDA IPC: CudaIpcTensor) mappings
        # (request id, epoch) -> (src ids, dst ids, source blocks, runs or None): see _plan
        self._plans: collections.OrderedDict[tuple[str, int], tuple] = collections.OrderedDict()
        self.shards: list[HeadShard] = []  # D's pools [L, 2, N, bs, h, D], each with its heads
        try:
            for p in pools:
                if not start <= p.kv_head_start < p.kv_head_end <= start + layout.num_kv_heads:
                    raise ValueError(f"shared pool {p.name}: KV heads outside the destination's layout")
                shape = (layout.num_layers, 2, layout.num_blocks, layout.block_size, p.kv_head_end - p.kv_head_start)
                width = kv_rows.row_width(layout.head_dim, layout.dtype)  # int8, uint8 (fp8): values + their scale
                pool = self._attach(p.name, (*shape, width), torch_dtype(layout.dtype))
                self._mapped.append(pool)
                assert pool.tensor is not None
                self.shards.append(HeadShard(p.kv_head_start, p.kv_head_end, pool.tensor, p.name))
            self.heads = head_span(self.shards)  # [first, last) head a frame may carry
            super().__init__(Outbox(self.ctx, auth, kv_addr, sndhwm=sndhwm), send_timeout_ms=send_timeout_ms)
        except BaseException:
            for pool in self._mapped:
                pool.close()
            raise

    def send_layer(
        self, request_id, lease, layer, src_kv_layer, src_block_ids, dst_block_ids, *, deadline=None, kv_head_start=0
    ) -> int:
        epoch, deadline, leased = self._lease_terms(lease, deadline)
        if deadline is None:
            raise ValueError("shared-memory writes need the lease deadline: pass the Lease (or deadline=)")
        if self._closed:
            raise KvSendError("sender is closed")
        num_layers = self.layout.num_layers
        runs = self._plan(request_id, epoch, src_kv_layer, src_block_ids, dst_block_ids, leased)
        if layer >= num_layers:  # a draft model's layer: D's draft pool is not shared, send it
            self._check_deadline(deadline)
            return self._send_payload(request_id, epoch, layer, src_kv_layer, src_block_ids, dst_block_ids)
        if not 0 <= layer < num_layers:
            raise ValueError(f"layer {layer} outside the destination pool's {num_layers} layers")
        h0, h1 = kv_head_start, kv_head_start + src_kv_layer.shape[3]
        if not self.heads[0] <= h0 < h1 <= self.heads[1]:
            raise ValueError(f"KV heads [{h0}, {h1}) outside the destination pool's {list(self.heads)}")
        pool0 = self.shards[0].pool  # [L, 2, N, bs, h, D]
        if src_kv_layer.shape[2] != pool0.shape[3] or src_kv_layer.shape[4:] != pool0.shape[5:]:
            raise ValueError(f"source layer {list(src_kv_layer.shape[2:])} does not match the destination pool's")
        if src_kv_layer.dtype != pool0.dtype:
            raise ValueError(f"source dtype {src_kv_layer.dtype} is not the destination pool's {pool0.dtype}")
        with self._writing():
            for o in overlaps(h0, h1, self.shards):  # every rank pool holding some of these heads
                self._check_deadline(deadline, self.deadline_margin_s)  # D may reuse the blocks after it
                pool = o.shard.pool
                whole = o.src == 0 and o.dst == 0 and o.count == src_kv_layer.shape[3] == pool.shape[4]
                on_cpu = pool.device.type == "cpu" and src_kv_layer.device.type == "cpu"
                if whole and on_cpu and runs is not None and src_kv_layer.is_contiguous() and pool.is_contiguous():
                    _copy_runs_flat(pool, layer, src_kv_layer, runs)
                    continue
                dst = o.shard.pool[layer][:, :, :, o.dst : o.dst + o.count]  # [2, N, bs, count, D]
                src = src_kv_layer[:, :, :, o.src : o.src + o.count]  # [2, N_src, bs, count, D]
                self._copy(dst, list(dst_block_ids), src, list(src_block_ids), (request_id, epoch))
        shape = [2, len(dst_block_ids), *src_kv_layer.shape[2:]]
        nbytes = math.prod(shape) * src_kv_layer.element_size()  # the heads once, replicas not counted
        header = KvFrameHeader(
            request_id=request_id,
            lease_epoch=epoch,
            layer=layer,
            block_ids=list(dst_block_ids),
            kv_head_start=h0,
            kv_head_end=h1,
            dtype=dtype_name(src_kv_layer.dtype),
            shape=shape,
            nbytes=nbytes,
            seq=self._next_seq(request_id, epoch),
            in_place=True,
        )
        self._publish(header)
        return nbytes

    # --- what a GPU pool's sender (kvtransfer/cuda_ipc_sender.py) does otherwise ---------------
    def _attach(self, name: str, shape: tuple[int, ...], dtype: torch.dtype):
        """Map one of D's pools (shared memory here) as an object with `.tensor` and `close()`."""
        return SharedTensor.attach(name, shape, dtype)

    def _copy(
        self, dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int], key: tuple[str, int]
    ) -> None:
        """dst[:, dst_ids] = src[:, src_ids] for one pool's heads of a layer (`key`: the lease's
        (request id, epoch), whose ids repeat for each of its layers)."""
        copy_blocks(dst, dst_ids, src, src_ids)

    def _writing(self) -> contextlib.AbstractContextManager:
        """Where a layer's copies run (here: inline, done when they return)."""
        return contextlib.nullcontext()

    def _publish(self, header: KvFrameHeader) -> None:
        """Tell D the layer is written (here: at once, the copies are done)."""
        self._send(header, [])

    def _plan(
        self,
        request_id: str,
        epoch: int,
        src_kv_layer: torch.Tensor,
        src_ids: list[int],
        dst_ids: list[int],
        leased: list[int] | None,
    ) -> list[tuple[int, int, int]] | None:
        """The block runs of this call's ids, checked once for all of a chunk's layers (each layer
        of a request's chunk names the same ids); None when they are too scattered for slice copies."""
        if src_kv_layer.dim() != 5 or src_kv_layer.shape[0] != 2:
            raise ValueError(f"src_kv_layer must be [2, N, bs, Hkv, D], got {list(src_kv_layer.shape)}")
        key = (request_id, epoch)
        plan = self._plans.get(key)
        if plan is not None and plan[0] == src_ids and plan[1] == dst_ids and plan[2] == src_kv_layer.shape[1]:
            return plan[3]
        self._check_args(src_kv_layer, src_ids, dst_ids, leased)
        if min(dst_ids) < 0 or max(dst_ids) >= self.layout.num_blocks:
            raise ValueError(f"destination block ids outside [0, {self.layout.num_blocks})")
        runs = _runs(src_ids, dst_ids)
        self._plans.pop(key, None)
        self._plans[key] = (
            list(src_ids),
            list(dst_ids),
            src_kv_layer.shape[1],
            runs if _few(runs, len(dst_ids)) else None,
        )
        while len(self._plans) > _MAX_TRACKED_REQUESTS:
            self._plans.popitem(last=False)
        return self._plans[key][3]

    def _forget(self, request_id: str, epoch: int) -> None:
        super()._forget(request_id, epoch)
        self._plans.pop((request_id, epoch), None)

    def _send_payload(self, request_id, epoch, layer, src_kv_layer, src_ids, dst_ids) -> int:
        """One frame carrying the blocks' bytes (a layer D's shared pool does not hold)."""
        ids = torch.as_tensor(src_ids, dtype=torch.long, device=src_kv_layer.device)
        data = src_kv_layer.index_select(1, ids).contiguous()  # [2, n, bs, H, D]
        header = KvFrameHeader(
            request_id=request_id,
            lease_epoch=epoch,
            layer=layer,
            block_ids=list(dst_ids),
            kv_head_start=0,
            kv_head_end=data.shape[3],
            dtype=dtype_name(data.dtype),
            shape=list(data.shape),
            nbytes=data.nbytes,
            seq=self._next_seq(request_id, epoch),
        )
        self._send(header, [data.cpu().reshape(-1).view(torch.uint8).numpy()])
        return header.nbytes

    def close(self) -> None:
        if not self._closed:
            for pool in self._mapped:
                pool.close()
        super().close()


# --- factory --------------------------------------------------------------------------------------
def make_kv_sender(
    transport: str,
    *,
    ctx: zmq.Context,
    auth: FrameAuth,
    kv_addr: str,
    shm_name: str | None = None,
    layout: KvLayout | None = None,
    shm_pools: list[ShmPool] | None = None,
    payload_mac: bool = False,
    **kwargs,
) -> KvSender:
    """A new sender to one decode worker: `transport` "zmq" (tcp/ipc per kv_addr), "shm" (needs
    the worker's shm_name and its pool `layout`; a tensor-parallel worker's rank `shm_pools`) or
    "cuda-ipc" (the same for a GPU pool: shm_name is its CUDA IPC name, kvtransfer/cuda_ipc.py). `payload_mac`: zmq only, MAC each payload's
    bytes (shm writes in place: nothing travels to authenticate). A prefill worker keeps one per
    destination (kvtransfer/sender_cache.py)."""
    if transport not in ("zmq", "shm", "cuda-ipc"):
        raise ValueError(f"unknown KV transport {transport!r} (zmq, shm or cuda-ipc)")
    if transport in ("shm", "cuda-ipc"):
        if not shm_name or layout is None:
            raise ValueError(f"{transport} transport needs the decode worker's pool name and KV layout")
        if transport == "cuda-ipc":
            from pdserve.kvtransfer.cuda_ipc_sender import CudaIpcKvSender

            return CudaIpcKvSender(auth, kv_addr, shm_name, layout, pools=shm_pools, ctx=ctx, **kwargs)
        return ShmKvSender(auth, kv_addr, shm_name, layout, pools=shm_pools, ctx=ctx, **kwargs)
    return ZmqKvSender(ctx, auth, kv_addr, payload_mac=payload_mac, **kwargs)
