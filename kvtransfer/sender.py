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
    def send_layer(self, request_id, lease, layer, src_kv_layer, src_block_ids, dst_block_ids) -> int:
        self._check_deadline(lease)
        idx = torch.tensor(src_block_ids, dtype=torch.long)
        data = src_kv_layer.index_select(1, idx)  # [2, n, bs, Hkv, D], contiguous copy
        if data.dtype == torch.bfloat16:  # numpy has no bf16: ship the raw bits
            data = data.view(torch.int16)
        header = KvLayer(request_id=request_id, lease_epoch=lease.epoch, layer=layer,
                         block_ids=list(dst_block_ids), kv_head_start=0, kv_head_end=src_kv_layer.shape[3],
                         dtype=str(src_kv_layer.dtype).removeprefix("torch."), nbytes=data.numel() * data.element_size())
        self.outbox.send(header, payloads=[data.numpy()])  # zero-copy: the frame holds the array
        return header.nbytes


class ShmKvSender(KvSender):
    def __init__(self, outbox: Outbox, shm_name: str, layout: KvLayout) -> None:
        super().__init__(outbox)
        shape = (layout.num_layers, 2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self._pool = SharedTensor.attach(shm_name, shape, torch_dtype(layout.dtype))

    def send_layer(self, request_id, lease, layer, src_kv_layer, src_block_ids, dst_block_ids) -> int:
        self._check_deadline(lease)
        dst = self._pool.tensor[layer]  # [2, N_dst, bs, Hkv, D]
        src = src_kv_layer.index_select(1, torch.tensor(src_block_ids, dtype=torch.long))
        dst.index_copy_(1, torch.tensor(dst_block_ids, dtype=torch.long), src)
        nbytes = src.numel() * src.element_size()
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
