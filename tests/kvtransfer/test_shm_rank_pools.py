"""Shared memory into a tensor-parallel decode worker: its rank pools are advertised one by one
(`ShmPool`), and the prefill side writes each frame's heads in place into every rank pool holding
them (replicas too); the receiver accounts for the in-place headers; deadlines fence every pool."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kvtransfer.head_ranges import HeadShard, distinct_shards, rank_kv_heads
from pdserve.kvtransfer.lease import QUARANTINE_GRACE_S, LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import LeaseExpired, ShmKvSender
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDone, KvLayout, Lease, ShmPool

L, N, BS, D = 2, 10, 4, 8
AUTH = FrameAuth(b"s" * 32, encryption="off")


class RankPools:
    """A TP-`degree` decode worker's KV pools in shared memory, filled with -1."""

    def __init__(self, hkv: int, degree: int) -> None:
        self.hkv = hkv
        self.shared: list[SharedTensor] = []
        self.shards: list[HeadShard] = []
        for rank in range(degree):
            k0, k1 = rank_kv_heads(hkv, rank, degree)
            t = SharedTensor.create((L, 2, N, BS, k1 - k0, D), torch.float32)
            assert t.tensor is not None
            t.tensor.fill_(-1.0)
            self.shared.append(t)
            self.shards.append(HeadShard(k0, k1, t.tensor, t.name))

    @property
    def advertised(self) -> list[ShmPool]:
        return [ShmPool(str(s.shm_name), s.start, s.end) for s in self.shards]

    @property
    def layout(self) -> KvLayout:
        return KvLayout(L, N, BS, self.hkv, D, "float32")

    def close(self) -> None:
        for t in self.shared:
            t.close()


def prefill_rank_pools(full: torch.Tensor, degree: int) -> list[HeadShard]:
    """A TP-`degree` prefill worker's pools (views of `full` [L, 2, N, bs, Hkv, D])."""
    out = []
    for rank in range(degree):
        k0, k1 = rank_kv_heads(full.shape[4], rank, degree)
        out.append(HeadShard(k0, k1, full[:, :, :, :, k0:k1]))
    return out


def drain(rx: KvReceiver, timeout_s: float = 5.0) -> list[KvDone]:
    done: list[KvDone] = []
    deadline = time.monotonic() + timeout_s
    while not done and time.monotonic() < deadline:
        done += rx.poll(50)
    return done


CASES = [(hkv, p, d) for hkv in (1, 2, 4) for p in (1, 2, 4) for d in (2, 4) if max(p, d) <= 4 * hkv]


@pytest.mark.parametrize("hkv,p,d", CASES)
def test_in_place_writes_land_in_every_decode_rank_pool_holding_the_heads(ctx, hkv, p, d):
    full = torch.randn(L, 2, 12, BS, hkv, D)  # the prefill worker's KV, all ranks together
    src_blocks, dst_blocks = [3, 7, 8], [1, 5, 6]
    dst = RankPools(hkv, d)
    leases = LeaseTable(L)
    try:
        with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", dst.shards[0].pool, leases, rank_pools=dst.shards) as rx:
            lease = leases.grant("r", dst_blocks, ttl_s=30)
            sender = ShmKvSender(AUTH, rx.addr, dst.advertised[0].name, dst.layout, pools=dst.advertised, ctx=ctx)
            frames = distinct_shards(prefill_rank_pools(full, p))
            sent = 0
            for layer in range(L):
                for s in frames:
                    sent += sender.send_layer(
                        "r", lease, layer, s.pool[layer], src_blocks, dst_blocks, kv_head_start=s.start
                    )
            assert sent == full[:, :, src_blocks].nbytes  # each head once, replicas not counted
            sender.send_done(KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=L, kv_bytes=sent))
            assert [x.request_id for x in drain(rx)] == ["r"]
            assert rx.frames_received == L * len(frames) and not rx.dropped
            sender.close()
        for r in dst.shards:
            assert torch.equal(r.pool[:, :, dst_blocks], full[:, :, src_blocks][:, :, :, :, r.start : r.end])
            others = [b for b in range(N) if b not in dst_blocks]
            assert bool((r.pool[:, :, others] == -1).all())
    finally:
        dst.close()


def test_no_rank_pool_is_written_past_the_deadline_and_revoked_blocks_stay_quarantined(ctx):
    dst = RankPools(2, 2)
    leases = LeaseTable(L)
    src = torch.ones(2, 4, BS, 2, D)  # both heads: one write per rank pool
    try:
        with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", dst.shards[0].pool, leases, rank_pools=dst.shards) as rx:
            sender = ShmKvSender(
                AUTH, rx.addr, dst.advertised[0].name, dst.layout, pools=dst.advertised, ctx=ctx, deadline_margin_s=0.1
            )
            past = Lease(epoch=1, block_ids=[2], deadline=time.time() - 0.01)
            almost = Lease(epoch=1, block_ids=[2], deadline=time.time() + 0.05)  # inside the margin
            for lease in (past, almost):
                with pytest.raises(LeaseExpired):
                    sender.send_layer("r", lease, 0, src, [0], [2])
            assert all(bool((s.pool == -1).all()) for s in dst.shards)

            # revoked on D while P still holds it: P's write lands only in the quarantined blocks,
            # its header is refused, and the blocks come back only after the deadline + grace
            lease = leases.grant("q", [4], ttl_s=5)
            assert leases.revoke("q")
            sender.send_layer("q", lease, 0, src, [0], [4])
            assert drain(rx, timeout_s=0.5) == [] and rx.dropped == {"unknown_lease": 1}
            assert leases.reclaimable() == []
            assert leases.reclaimable(now=lease.deadline + QUARANTINE_GRACE_S + 0.01) == [4]
            sender.close()
    finally:
        dst.close()


def test_the_sender_refuses_pools_and_heads_outside_the_destination(ctx):
    dst = RankPools(2, 2)
    try:
        layout, pools = dst.layout, dst.advertised
        with pytest.raises(ValueError, match="outside the destination's layout"):
            ShmKvSender(AUTH, "ipc:///nowhere", pools[0].name, layout, pools=[ShmPool(pools[0].name, 1, 3)], ctx=ctx)
        with pytest.raises(ValueError, match="uncovered"):  # rank pools with a hole in their heads
            three = KvLayout(L, N, BS, 3, D, "float32")
            ShmKvSender(
                AUTH, "ipc:///nowhere", pools[0].name, three, pools=[pools[0], ShmPool(pools[1].name, 2, 3)], ctx=ctx
            )
        sender = ShmKvSender(AUTH, "ipc:///nowhere", pools[0].name, layout, pools=pools, ctx=ctx)
        ok = Lease(epoch=1, block_ids=[2], deadline=time.time() + 30)
        with pytest.raises(ValueError, match="outside the destination pool"):
            sender.send_layer("r", ok, 0, torch.ones(2, 4, BS, 1, D), [0], [2], kv_head_start=2)
        sender.close()
        assert all(bool((s.pool == -1).all()) for s in dst.shards)
    finally:
        dst.close()
