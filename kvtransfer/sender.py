"""Prefill side of KV transfer: ship one layer's blocks to a decode worker.

ZmqKvSender: gathers the blocks into one contiguous tensor and sends it zero-copy
             (header frame + raw frame) over TCP or IPC.
ShmKvSender: writes straight into the decode worker's shared KV pool (one copy), then sends
             only the small header so D can account for the layer.
Both refuse to write once the lease deadline has passed (see kvtransfer/lease.py).
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod

import torch
import zmq

from kvtransfer.block_copy import copy_blocks
from kvtransfer.shm import SharedTensor
from protocol.auth import FrameAuth
from protocol.channel import Outbox
from protocol.messages import KvDone, KvLayer, KvLayout, Lease

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {name!r}") from None


class LeaseExpired(RuntimeError):
    pass


class KvSender(ABC):
    """Owned by a prefill worker, one per destination; called from the forward pass."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox

    @abstractmethod
    def send_layer(self, request_id: str, lease: Lease, layer: int, src_kv_layer: torch.Tensor,
                   src_block_ids: list[int], dst_block_ids: list[int]) -> int:
        """src_kv_layer [2, N, bs, Hkv, D]; returns the bytes moved."""

    def send_done(self, done: KvDone) -> None:
        self.outbox.send(done)

    def close(self) -> None:
        self.outbox.close()

    @staticmethod
    def _check_deadline(lease: Lease) -> None:
        if time.time() > lease.deadline:
            raise LeaseExpired(f"lease epoch {lease.epoch} expired; not writing")


class ZmqKvSender(KvSender):
    """Packs blocks into a reusable staging buffer and sends it zero-copy. A buffer is reused
    only after ZMQ reports it sent (MessageTracker): no fresh allocation per layer."""

    RING = 4

    def __init__(self, outbox: Outbox) -> None:
        super().__init__(outbox)
        self._ring: list[tuple[torch.Tensor, zmq.MessageTracker | None]] = []
        self._next = 0

    def _staging(self, like: torch.Tensor, n_blocks: int) -> tuple[torch.Tensor, int]:
        """A contiguous [2, n_blocks, bs, Hkv, D] view on the next free ring buffer."""
        shape = (2, n_blocks, *like.shape[2:])
        numel = 2 * n_blocks * like[0, 0].numel()
        slot = self._next
        self._next = (self._next + 1) % self.RING
        if slot == len(self._ring):
            self._ring.append((torch.empty(0, dtype=like.dtype), None))
        buf, tracker = self._ring[slot]
        if tracker is not None and not tracker.done:
            tracker.wait()
        if buf.numel() < numel or buf.dtype != like.dtype:
            buf = torch.empty(numel, dtype=like.dtype)  # 1-D storage, grown on demand
        self._ring[slot] = (buf, None)
        return buf[:numel].view(shape), slot

    def send_layer(self, request_id, lease, layer, src_kv_layer, src_block_ids, dst_block_ids) -> int:
        self._check_deadline(lease)
        data, slot = self._staging(src_kv_layer, len(src_block_ids))  # [2, n, bs, Hkv, D]
        copy_blocks(data, list(range(len(src_block_ids))), src_kv_layer, src_block_ids)
        raw = data.view(torch.int16) if data.dtype == torch.bfloat16 else data  # numpy has no bf16
        header = KvLayer(request_id=request_id, lease_epoch=lease.epoch, layer=layer,
                         block_ids=list(dst_block_ids), kv_head_start=0, kv_head_end=src_kv_layer.shape[3],
                         dtype=str(src_kv_layer.dtype).removeprefix("torch."), nbytes=data.numel() * data.element_size())
        tracker = self.outbox.send_tracked(header, payloads=[raw.numpy()])
        self._ring[slot] = (self._ring[slot][0], tracker)
        return header.nbytes


class ShmKvSender(KvSender):
    def __init__(self, outbox: Outbox, shm_name: str, layout: KvLayout) -> None:
        super().__init__(outbox)
        shape = (layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self._pool = SharedTensor.attach(shm_name, shape, torch_dtype(layout.dtype))

    def send_layer(self, request_id, lease, layer, src_kv_layer, src_block_ids, dst_block_ids) -> int:
        self._check_deadline(lease)
        copy_blocks(self._pool.tensor[layer], dst_block_ids, src_kv_layer, src_block_ids)
        nbytes = 2 * len(src_block_ids) * src_kv_layer[0, 0].numel() * src_kv_layer.element_size()
        self.outbox.send(KvLayer(request_id=request_id, lease_epoch=lease.epoch, layer=layer,
                                 block_ids=list(dst_block_ids), kv_head_start=0,
                                 kv_head_end=src_kv_layer.shape[3],
                                 dtype=str(src_kv_layer.dtype).removeprefix("torch."),
                                 nbytes=nbytes, in_place=True))
        return nbytes

    def close(self) -> None:
        self._pool.close()
        super().close()


def make_kv_sender(transport: str, *, ctx: zmq.Context, auth: FrameAuth, kv_addr: str,
                   shm_name: str | None, layout: KvLayout) -> KvSender:
    """`layout` is the DESTINATION pool's layout for shm (block count differs per worker)."""
    outbox = Outbox(ctx, auth, kv_addr)
    if transport == "shm":
        if shm_name is None:
            raise ValueError("shm transport needs the decode worker's shared-memory name")
        return ShmKvSender(outbox, shm_name, layout)
    if transport == "zmq":
        return ZmqKvSender(outbox)
    raise ValueError(f"unknown KV transport {transport!r}")
