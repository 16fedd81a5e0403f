"""Prefill side of KV over CUDA IPC: write each layer's blocks straight into the decode worker's
GPU pool (mapped once, kvtransfer/cuda_ipc.py), on a side stream, while the next layer computes.

    compute stream:  layer l (stores its KV) | layer l+1 | layer l+2 | ...
                                  \\ event
    copy stream:                   copy l's blocks into D's leased slots -> event E_l
    control plane:                 header of l, once E_l has completed (polled at each later
                                   call; waited for before KvDone / KvRangeDone / KvRelease)

D reads the blocks only after KvDone, which follows every header, which follows its copy: D never
reads a block before P's copy of it is complete. The lease's fencing is the shared-memory writer's
(ShmKvSender): no copy starts within `deadline_margin_s` of the deadline, and D quarantines the
blocks until after it, so a late copy never lands in blocks owned by someone else. P's own blocks
stay untouched until the request's KvDone (which waits for its copies), so freeing them after it
cannot race a copy still reading them.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading

import torch

from pdserve.kvtransfer.cuda_ipc import CudaIpcTensor
from pdserve.kvtransfer.sender import KvSendError, ShmKvSender
from pdserve.kvtransfer.wire import KvFrameHeader
from pdserve.protocol.messages import KvDone

log = logging.getLogger(__name__)


class CudaIpcKvSender(ShmKvSender):
    transport = "cuda-ipc"

    def __init__(self, *args, **kwargs) -> None:
        self._stream: torch.cuda.Stream | None = None
        self._pending: collections.deque[tuple[torch.cuda.Event, KvFrameHeader]] = collections.deque()
        self._lock = threading.Lock()  # lanes publish layers while the worker's loop sends KvDone
        # (request id, epoch) -> (src ids, dst ids, as device tensors): made once per lease, not per layer
        self._ids: collections.OrderedDict[tuple[str, int], tuple[list[int], list[int], torch.Tensor, torch.Tensor]]
        self._ids = collections.OrderedDict()
        # a benchmark's (start, end) events of each layer's copies (None: not timed)
        self.copy_times: list[tuple[torch.cuda.Event, torch.cuda.Event]] | None = None
        self._copy_started: torch.cuda.Event | None = None
        super().__init__(*args, **kwargs)
        self._stream = torch.cuda.Stream(self.shards[0].pool.device)

    def _copy(
        self, dst: torch.Tensor, dst_ids: list[int], src: torch.Tensor, src_ids: list[int], key: tuple[str, int]
    ) -> None:
        """Whole contiguous layers on one GPU: one gather-scatter launch (kvtransfer/gpu_block_copy.py)
        with the lease's ids on the device; else the generic block copy."""
        from pdserve.kvtransfer import gpu_block_copy

        if not gpu_block_copy.takes(dst, src):
            return super()._copy(dst, dst_ids, src, src_ids, key)
        ids = self._ids.get(key)
        if ids is None or ids[0] != src_ids or ids[1] != dst_ids:
            both = torch.tensor([src_ids, dst_ids], dtype=torch.int32).to(src.device, non_blocking=True)  # [2, n]
            ids = self._ids[key] = (list(src_ids), list(dst_ids), both[0], both[1])
            while len(self._ids) > 1024:  # leases that never reached KvDone / KvRelease
                self._ids.popitem(last=False)
        gpu_block_copy.copy_blocks(dst, ids[3], src, ids[2])

    def _forget(self, request_id: str, epoch: int) -> None:
        super()._forget(request_id, epoch)
        self._ids.pop((request_id, epoch), None)

    def _attach(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> CudaIpcTensor:
        return CudaIpcTensor.attach(name, shape, dtype)

    def _writing(self) -> contextlib.AbstractContextManager:
        """The copies run on the side stream, after what the compute stream has queued (this
        layer's KV stores)."""
        assert self._stream is not None
        self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        if self.copy_times is not None:
            self._copy_started = torch.cuda.Event(enable_timing=True)
            self._copy_started.record(self._stream)
        return torch.cuda.stream(self._stream)

    def _publish(self, header: KvFrameHeader) -> None:
        assert self._stream is not None
        timed = self.copy_times is not None and self._copy_started is not None
        done = torch.cuda.Event(enable_timing=timed)
        done.record(self._stream)
        if timed:
            assert self.copy_times is not None and self._copy_started is not None
            self.copy_times.append((self._copy_started, done))
        with self._lock:
            self._pending.append((done, header))
        self._flush(wait=False)

    def _flush(self, wait: bool) -> None:
        """Send the headers of layers whose copies are complete (`wait`: all of them), in order."""
        with self._lock:
            self._flush_locked(wait)

    def _flush_locked(self, wait: bool) -> None:
        while self._pending:
            done, header = self._pending[0]
            if not wait and not done.query():
                return
            done.synchronize()
            self._pending.popleft()
            self._send(header, [])

    def _flushed(self) -> bool:
        """Every header sent; False (logged) when D's queue stayed full."""
        try:
            self._flush(wait=True)
        except KvSendError as e:
            log.error("KV headers to %s not sent: %s", self.outbox.addr, e)
            return False
        return True

    def send_done(self, done: KvDone) -> bool:
        return self._flushed() and super().send_done(done)

    def send_range_done(self, request_id: str, lease_epoch: int, heads: tuple[int, int], kv_bytes: int) -> bool:
        return self._flushed() and super().send_range_done(request_id, lease_epoch, heads, kv_bytes)

    def send_release(self, request_id: str, lease_epoch: int) -> bool:
        return self._flushed() and super().send_release(request_id, lease_epoch)

    def close(self) -> None:
        if not self.closed and self._stream is not None:
            self._stream.synchronize()  # no copy may still write through a mapping closed below
            self._pending.clear()
        super().close()
