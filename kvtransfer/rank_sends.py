"""Per-rank KV sends of a tensor-parallel prefill worker: each rank ships the KV heads it computed,
on a sender (socket, shared-memory mapping) of its own, in parallel with the other ranks.

    rank 0   plans the step's transfers (prefill_node/kv_streamer.py), broadcasts them with the
             step (`RankPlan`, msgpack bytes; engine/parallel/step_inputs.py), sends its own heads
             and, after the request's last layer, KvDone naming `range_dones` = the other ranks'
             streams D must hear from first
    rank r   `RankKvSends`: after each layer stored its KV, sends its heads [k0, k1) of every
             planned job to the job's decode worker; after the last layer of a request's last
             chunk, a KvRangeDone with the bytes it sent for the lease (FIFO after its frames)

A head range held by several ranks (fewer KV heads than ranks) is sent by the lowest of them
only. Fencing holds per rank: each send checks the lease deadline the plan carries (the lease as
last renewed when the step launched, never later than D's), and each rank's shared-memory writes
of a step finish inside that step's collectives, which rank 0 waits on, so a KvRelease rank 0
sends after a step never overtakes a rank's in-place write. A rank whose send fails (lease run
out, decode worker gone) stops sending for that request and sends no KvRangeDone: D holds rank
0's KvDone until the lease runs out, so the request fails (rank 0 sees the same deadline).
"""

from __future__ import annotations

import collections
import logging

import msgspec
import torch
import zmq

from pdserve.kvtransfer.sender import KvTransferError
from pdserve.kvtransfer.sender_cache import KvSenderCache
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDestination

log = logging.getLogger(__name__)

_MAX_TRACKED = 4096  # requests whose byte counts a rank keeps (aborted ones never finish)


class RankKvJob(msgspec.Struct, frozen=True, array_like=True):
    """One request's blocks in this step: P's `src_blocks` into D's `dst_blocks` (dest.lease's)."""

    request_id: str
    dest: KvDestination  # its lease as last renewed
    src_blocks: list[int]
    dst_blocks: list[int]
    last: bool  # the request's last chunk: its KvRangeDone follows the last layer


class RankPlan(msgspec.Struct, frozen=True, array_like=True):
    jobs: list[RankKvJob]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(RankPlan)


def encode_plan(jobs: list[RankKvJob]) -> bytes:
    return _encoder.encode(RankPlan(jobs)) if jobs else b""


def decode_plan(data: bytes) -> list[RankKvJob]:
    return _decoder.decode(data).jobs if data else []


def sends_own_heads(rank: int, heads: list[tuple[int, int]]) -> bool:
    """Whether `rank` sends its heads: the lowest rank holding its range does (`heads`: every rank's)."""
    return heads.index(heads[rank]) == rank


class RankKvSends:
    """Rank r's sender side: `plan(data)` at each step, then it is the step's per-layer hook."""

    def __init__(self, pool: torch.Tensor, heads: tuple[int, int], auth: FrameAuth, payload_mac_mode: str) -> None:
        self.pool = pool  # [L, 2, N, bs, k1 - k0, D], this rank's
        self.heads = heads
        self.ctx = zmq.Context()
        self.senders = KvSenderCache(self.ctx, auth, payload_mac_mode)  # one per decode worker
        self.jobs: list[RankKvJob] = []
        self.sent: collections.OrderedDict[tuple[str, int], int] = collections.OrderedDict()  # bytes per lease
        self.failed: collections.OrderedDict[tuple[str, int], None] = collections.OrderedDict()

    def plan(self, data: bytes) -> None:
        self.jobs = decode_plan(data)

    def __call__(self, layer: int) -> None:
        """After `layer` stored this rank's KV: send it for every job (and, after the last layer,
        each finishing request's KvRangeDone)."""
        last_layer = layer == self.pool.shape[0] - 1
        for job in self.jobs:
            key = (job.request_id, job.dest.lease.epoch)
            if key in self.failed:
                if last_layer and job.last:
                    del self.failed[key]
                continue
            try:
                sender = self.senders.get(job.dest)
                n = sender.send_layer(
                    job.request_id,
                    job.dest.lease,
                    layer,
                    self.pool[layer],  # [2, N, bs, k1 - k0, D]
                    job.src_blocks,
                    job.dst_blocks,
                    kv_head_start=self.heads[0],
                )
                self.sent[key] = self.sent.pop(key, 0) + n
                while len(self.sent) > _MAX_TRACKED:
                    self.sent.popitem(last=False)
                if last_layer and job.last:
                    if not sender.send_range_done(job.request_id, key[1], self.heads, self.sent.pop(key)):
                        raise KvTransferError("KvRangeDone not sent: queue full")
            except (KvTransferError, ValueError, OSError) as e:  # this request only
                log.warning("KV heads %s of %s not sent: %s", self.heads, job.request_id, e)
                self.sent.pop(key, None)
                if not (last_layer and job.last):
                    self.failed[key] = None
                    while len(self.failed) > _MAX_TRACKED:
                        self.failed.popitem(last=False)

    def close(self) -> None:
        self.senders.close()
        self.ctx.destroy(linger=0)
