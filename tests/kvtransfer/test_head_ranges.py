"""KV heads re-sliced between tensor-parallel degrees: every decode rank's pool gets exactly its
heads (replicas included) from the prefill ranks' frames, through the real ZMQ sender/receiver,
and a missing head range fails the request's KvDone."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import cast

import pytest
import torch
import zmq

from pdserve.engine.config import ModelConfig
from pdserve.engine.parallel.shard import TensorParallelShard
from pdserve.kvtransfer.head_ranges import HeadShard, distinct_shards, head_span, overlaps
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import ZmqKvSender
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDone

L, N, BS, D = 2, 10, 4, 8
AUTH = FrameAuth(b"h" * 32, encryption="off")


def rank_pools(full: torch.Tensor, degree: int, fill: float | None = None) -> list[HeadShard]:
    """`degree` ranks' pools of `full` [L, 2, N, bs, Hkv, D], split as the engine splits KV heads."""
    hkv = full.shape[4]
    cfg = cast(ModelConfig, SimpleNamespace(num_kv_heads=hkv))  # all kv_heads() reads
    shards = []
    for rank in range(degree):
        k0, k1 = TensorParallelShard(rank, degree).kv_heads(cfg)
        pool = full[:, :, :, :, k0:k1].clone() if fill is None else torch.full_like(full[:, :, :, :, k0:k1], fill)
        shards.append(HeadShard(k0, k1, pool))
    return shards


DEGREES = [(hkv, p, d) for hkv in (1, 2, 4) for p in (1, 2, 4) for d in (1, 2, 4) if max(p, d) <= 4 * hkv]


@pytest.mark.parametrize("hkv,p,d", DEGREES)
def test_head_ranges_map_every_prefill_head_onto_every_decode_rank_holding_it(hkv, p, d):
    full = torch.randn(L, 2, N, BS, hkv, D)
    senders, receivers = rank_pools(full, p), rank_pools(full, d, fill=-1.0)
    frames = distinct_shards(senders)
    assert [(s.start, s.end) for s in frames] == sorted({(s.start, s.end) for s in senders})
    assert head_span(frames) == (0, hkv)  # the frames cover every head once
    writes = {(id(r), h): 0 for r in receivers for h in range(r.start, r.end)}
    for f in frames:
        for o in overlaps(f.start, f.end, receivers):
            o.shard.pool[:, :, :, :, o.dst : o.dst + o.count] = f.pool[:, :, :, :, o.src : o.src + o.count]
            for h in range(o.count):
                writes[(id(o.shard), o.shard.start + o.dst + h)] += 1
    assert set(writes.values()) == {1}  # every head of every decode rank written exactly once
    for r in receivers:
        assert torch.equal(r.pool, full[:, :, :, :, r.start : r.end])


def test_head_span_refuses_a_gap():
    pool = torch.zeros(L, 2, N, BS, 1, D)
    with pytest.raises(ValueError, match="uncovered"):
        head_span([HeadShard(0, 1, pool), HeadShard(2, 3, pool)])
    with pytest.raises(ValueError, match="do not fit"):
        HeadShard(0, 2, pool)


def _drain(receiver: KvReceiver, timeout_s: float = 5.0) -> list[KvDone]:
    done: list[KvDone] = []
    deadline = time.monotonic() + timeout_s
    while not done and time.monotonic() < deadline:
        done += receiver.poll(50)
    return done


@pytest.mark.parametrize("p,d", [(2, 1), (1, 2), (2, 2), (4, 2)])
def test_zmq_frames_land_in_the_decode_rank_pools(p, d):
    """Prefill TP=p -> decode TP=d (4 KV heads; also 4 -> 2 with one head per prefill rank) over
    real sockets: one frame per prefill rank and layer, each decode rank pool gets its heads."""
    full = torch.randn(L, 2, 12, BS, 4, D)  # the prefill worker's KV, all ranks together
    src_blocks, dst_blocks = [3, 7, 8], [1, 5, 6]
    dst_full = torch.full((L, 2, N, BS, 4, D), -1.0)
    receivers = rank_pools(dst_full, d)
    ctx = zmq.Context()
    leases = LeaseTable(L)
    try:
        with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", receivers[0].pool, leases, rank_pools=receivers) as rx:
            lease = leases.grant("r", dst_blocks, ttl_s=30)
            sender = ZmqKvSender(ctx, AUTH, rx.addr)
            sent = 0
            for layer in range(L):
                for s in distinct_shards(rank_pools(full, p)):
                    sent += sender.send_layer(
                        "r", lease, layer, s.pool[layer], src_blocks, dst_blocks, kv_head_start=s.start
                    )
            sender.send_done(KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=L, kv_bytes=sent))
            assert [x.request_id for x in _drain(rx)] == ["r"]
            assert rx.frames_received == L * p and not rx.dropped
            sender.close()
    finally:
        ctx.destroy(linger=0)
    for r in receivers:
        got = r.pool[:, :, dst_blocks]  # [L, 2, 3, bs, h, D]
        assert torch.equal(got, full[:, :, src_blocks][:, :, :, :, r.start : r.end])
        others = [b for b in range(N) if b not in dst_blocks]
        assert bool((r.pool[:, :, others] == -1).all())


def test_a_missing_head_range_fails_the_kv_done():
    full = torch.randn(L, 2, 4, BS, 2, D)
    receivers = rank_pools(torch.zeros(L, 2, N, BS, 2, D), 2)
    ctx = zmq.Context()
    leases = LeaseTable(L)
    try:
        with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", receivers[0].pool, leases, rank_pools=receivers) as rx:
            lease = leases.grant("r", [2], ttl_s=30)
            sender = ZmqKvSender(ctx, AUTH, rx.addr)
            sent = 0
            for layer in range(L):
                sent += sender.send_layer("r", lease, layer, full[layer][:, :, :, 0:1], [0], [2], kv_head_start=0)
            sender.send_layer("r", lease, 0, full[0], [0], [2], kv_head_start=1)  # heads [1, 3): none has 2
            full_bytes = 2 * sent  # what both heads would have been
            sender.send_done(KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=L, kv_bytes=full_bytes))
            deadline = time.monotonic() + 5
            while not rx.failed_done and time.monotonic() < deadline:
                rx.poll(50)
            assert [(x.request_id, why) for x, why in rx.failed_done] == [("r", "bytes_mismatch")]
            assert dict(rx.dropped) == {"layout_mismatch": 1, "bytes_mismatch": 1}
            sender.close()
    finally:
        ctx.destroy(linger=0)
