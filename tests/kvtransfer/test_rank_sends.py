"""A prefill rank's own KV sends (`RankKvSends`, what ranks >= 1 of a tensor-parallel prefill
worker run as their per-layer hook): the step's plan from rank 0, its heads written into the
decode worker's rank pools, its KvRangeDone after the request's last layer, and its own fencing."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import torch
import zmq

from pdserve.kvtransfer.head_ranges import HeadShard
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.rank_sends import RankKvJob, RankKvSends, decode_plan, encode_plan, sends_own_heads
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import ShmKvSender
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDestination, KvDone, KvLayout, Lease, ShmPool

L, N, BS, H, D = 2, 10, 4, 2, 8
AUTH = FrameAuth(b"p" * 32, encryption="off")
SRC, DST = [3, 7], [1, 5]


class Decode:
    """A TP-2 decode worker's side: two shared rank pools (one KV head each), a receiver."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.segments = [SharedTensor.create((L, 2, N, BS, 1, D), torch.float32) for _ in range(2)]
        self.shards = [
            HeadShard(r, r + 1, t.tensor, t.name) for r, t in enumerate(self.segments) if t.tensor is not None
        ]
        self.pools = [ShmPool(t.name, r, r + 1) for r, t in enumerate(self.segments)]
        self.layout = KvLayout(L, N, BS, H, D, "float32")
        self.leases = LeaseTable(L)
        self.rx = KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", self.shards[0].pool, self.leases, rank_pools=self.shards)

    def dest(self, lease: Lease) -> KvDestination:
        return KvDestination("d", self.rx.addr, self.pools[0].name, "shm", lease, self.layout, self.pools)

    def poll(self, seconds: float) -> list[KvDone]:
        done: list[KvDone] = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not done:
            done += self.rx.poll(20)
        return done

    def close(self) -> None:
        self.rx.close()
        for t in self.segments:
            t.close()


@pytest.fixture
def decode() -> Iterator[Decode]:
    ctx = zmq.Context()
    d = Decode(ctx)
    yield d
    d.close()
    ctx.destroy(linger=0)


def test_the_plan_round_trips_and_the_lowest_rank_of_a_head_range_sends_it():
    lease = Lease(epoch=7, block_ids=[1, 5], deadline=123.0)
    dest = KvDestination(
        "d", "ipc:///x", "seg", "shm", lease, KvLayout(L, N, BS, H, D, "float32"), [ShmPool("seg", 0, 2)]
    )
    jobs = [RankKvJob("r", dest, SRC, DST, True)]
    assert decode_plan(encode_plan(jobs)) == jobs and encode_plan([]) == b"" and decode_plan(b"") == []
    with pytest.raises(msgspec.DecodeError):
        decode_plan(b"\xff not a plan")
    assert [sends_own_heads(r, [(0, 1), (1, 2)]) for r in range(2)] == [True, True]
    assert [sends_own_heads(r, [(0, 1), (0, 1), (1, 2), (1, 2)]) for r in range(4)] == [True, False, True, False]


def test_rank_1_sends_its_heads_and_its_marker_and_the_request_is_admitted(decode):
    full = torch.randn(L, 2, 8, BS, H, D)  # the prefill worker's KV: rank 0 head 0, rank 1 head 1
    lease = decode.leases.grant("r", DST, ttl_s=30)
    rank1 = RankKvSends(full[:, :, :, :, 1:2].clone(), (1, 2), AUTH, "auto")
    rank0 = ShmKvSender(AUTH, decode.rx.addr, decode.pools[0].name, decode.layout, pools=decode.pools)
    try:
        for chunk, (src, dst) in enumerate([(SRC[:1], DST[:1]), (SRC[1:], DST[1:])]):  # two chunks
            rank1.plan(encode_plan([RankKvJob("r", decode.dest(lease), src, dst, last=chunk == 1)]))
            for layer in range(L):
                rank1(layer)
        sent0 = sum(rank0.send_layer("r", lease, layer, full[layer][:, :, :, 0:1], SRC, DST) for layer in range(L))
        rank0.send_done(KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=L, kv_bytes=sent0, range_dones=1))
        assert [d.request_id for d in decode.poll(5)] == ["r"] and not decode.rx.dropped
        assert not rank1.sent  # its byte count went out with the marker
    finally:
        rank0.close()
        rank1.close()
    for s in decode.shards:
        assert torch.equal(s.pool[:, :, DST], full[:, :, SRC][:, :, :, :, s.start : s.end])


def test_a_rank_past_its_lease_writes_nothing_and_sends_no_marker(decode):
    """The plan carries the lease rank 0 knew at launch; past its deadline the rank writes no
    pool and sends no KvRangeDone, so D holds rank 0's KvDone (and the lease runs out)."""
    full = torch.randn(L, 2, 8, BS, H, D)
    for s in decode.shards:
        s.pool.fill_(-1.0)
    lease = decode.leases.grant("r", DST, ttl_s=30)
    stale = msgspec.structs.replace(lease, deadline=time.time() - 0.01)
    rank1 = RankKvSends(full[:, :, :, :, 1:2].clone(), (1, 2), AUTH, "auto")
    try:
        rank1.plan(encode_plan([RankKvJob("r", decode.dest(stale), SRC, DST, last=True)]))
        for layer in range(L):
            rank1(layer)
        done = KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=L, kv_bytes=0, range_dones=1)
        rank0 = ShmKvSender(AUTH, decode.rx.addr, decode.pools[0].name, decode.layout, pools=decode.pools)
        rank0.send_done(done)
        assert decode.poll(0.5) == [] and not decode.rx.failed_done  # held: rank 1's stream never finished
        assert not rank1.failed  # forgotten once its last chunk went by
        rank0.close()
    finally:
        rank1.close()
    assert all(bool((s.pool == -1).all()) for s in decode.shards)
