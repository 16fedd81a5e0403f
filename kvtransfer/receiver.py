"""Decode side of KV transfer: verify every frame against its lease, then land it in the pool.

Frames arrive on one PULL socket per decode worker, in order per prefill worker: the layer
frames of a request, then its KvDone. A frame is written only if it is authenticated, its
lease (request, epoch, deadline) is active, its blocks are the lease's, and its dtype and size
match this pool; anything else is dropped and counted, and the worker keeps running.
"""
from __future__ import annotations

import collections

import torch
import zmq

from kvtransfer.block_copy import copy_blocks
from kvtransfer.lease import LeaseTable
from kvtransfer.sender import torch_dtype
from protocol.auth import FrameAuth
from protocol.channel import Inbox
from protocol.messages import KvDone, KvLayer


class KvReceiver:
    def __init__(self, ctx: zmq.Context, auth: FrameAuth, bind_addr: str, kv_cache: torch.Tensor,
                 leases: LeaseTable) -> None:
        self.inbox = Inbox(ctx, auth, bind_addr)
        self.kv_cache = kv_cache  # [L, 2, N, bs, Hkv, D]
        self.leases = leases
        self.bytes_received = 0
        self.dropped: collections.Counter[str] = self.inbox.dropped  # auth/decode + lease reasons

    @property
    def addr(self) -> str:
        return self.inbox.addr

    @property
    def socket(self) -> zmq.Socket:
        return self.inbox.socket

    def poll(self, timeout_ms: int = 0) -> list[KvDone]:
        """Drain what has arrived; returns the requests whose KV is complete and verified."""
        done: list[KvDone] = []
        while (parsed := self.inbox.recv_raw(timeout_ms)) is not None:
            timeout_ms = 0
            msg, payloads = parsed
            if isinstance(msg, KvLayer):
                reason = self._accept_layer(msg, payloads)
            elif isinstance(msg, KvDone):
                reason = self.leases.check_done(msg)
                if reason is None:
                    done.append(msg)
            else:
                reason = "unexpected_message"
            if reason is not None:
                self.dropped[reason] += 1
        return done

    def _accept_layer(self, frame: KvLayer, payloads: list) -> str | None:
        reason = self.leases.check_frame(frame)
        if reason is not None:
            return reason
        _, _, _, bs, heads, dim = self.kv_cache.shape
        if frame.dtype != str(self.kv_cache.dtype).removeprefix("torch.") or frame.kv_head_end - frame.kv_head_start != heads:
            return "layout_mismatch"
        expected = 2 * len(frame.block_ids) * bs * heads * dim * self.kv_cache.element_size()
        if frame.nbytes != expected:
            return "size_mismatch"
        if not frame.in_place:
            if len(payloads) != 1 or payloads[0].nbytes != expected:
                return "size_mismatch"
            shape = (2, len(frame.block_ids), bs, heads, dim)
            data = torch.frombuffer(payloads[0], dtype=torch_dtype(frame.dtype)).view(shape)
            copy_blocks(self.kv_cache[frame.layer], frame.block_ids, data, list(range(len(frame.block_ids))))
        elif payloads:
            return "unexpected_payload"
        self.leases.mark_layer(frame)
        self.bytes_received += frame.nbytes
        return None

    def close(self) -> None:
        self.inbox.close()
