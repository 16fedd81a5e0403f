"""Per-rank KV streams: each prefill rank sends its own heads on a sender (socket) of its own and
ends with a KvRangeDone; rank 0's KvDone names how many such markers D waits for. D admits only
once every stream is done and every head range of every layer arrived, whatever the order."""

from __future__ import annotations

import time

import pytest
import torch

from pdserve.kvtransfer.head_ranges import HeadShard, rank_kv_heads
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import KvSender, ShmKvSender, ZmqKvSender
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvDone, KvLayout, Lease, ShmPool

L, N, BS, H, D = 3, 10, 4, 2, 8
AUTH = FrameAuth(b"r" * 32, encryption="off")
SRC, DST = [3, 7], [1, 5]


def poll_for(rx: KvReceiver, seconds: float) -> list[KvDone]:
    done: list[KvDone] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not done and not rx.failed_done:
        done += rx.poll(20)
    return done


def send_heads(sender: KvSender, lease: Lease, full: torch.Tensor, rank: int, layers: range = range(L)) -> int:
    """Rank `rank` of 2 sends its KV heads of `full` [L, 2, N', bs, H, D] for `layers`."""
    k0, k1 = rank_kv_heads(H, rank, 2)
    return sum(
        sender.send_layer("r", lease, layer, full[layer][:, :, :, k0:k1], SRC, DST, kv_head_start=k0)
        for layer in layers
    )


def done(lease: Lease, kv_bytes: int, range_dones: int = 1) -> KvDone:
    return KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=L, kv_bytes=kv_bytes, range_dones=range_dones)


@pytest.mark.parametrize("decode_degree", [1, 2])
def test_rank_0_done_first_waits_for_rank_1s_stream(ctx, decode_degree):
    """Rank 0's KvDone arrives before rank 1 sent anything: held, not failed; admitted once rank
    1's frames and marker are in, and every decode rank pool holds its heads."""
    full = torch.randn(L, 2, 8, BS, H, D)
    dst = [
        HeadShard(*rank_kv_heads(H, r, decode_degree), torch.full((L, 2, N, BS, H // decode_degree, D), -1.0))
        for r in range(decode_degree)
    ]
    leases = LeaseTable(L)
    with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", dst[0].pool, leases, rank_pools=dst) as rx:
        lease = leases.grant("r", DST, ttl_s=30)
        rank0, rank1 = ZmqKvSender(ctx, AUTH, rx.addr), ZmqKvSender(ctx, AUTH, rx.addr)
        rank0.send_done(done(lease, send_heads(rank0, lease, full, 0)))
        assert poll_for(rx, 0.5) == [] and not rx.failed_done and not rx.dropped  # held
        rank1.send_range_done("r", lease.epoch, (1, 2), send_heads(rank1, lease, full, 1))
        assert [d.request_id for d in poll_for(rx, 5)] == ["r"]
        assert not rx.dropped and rx.frames_received == 2 * L
        rank0.close()
        rank1.close()
    for s in dst:
        assert torch.equal(s.pool[:, :, DST], full[:, :, SRC][:, :, :, :, s.start : s.end])


def test_rank_streams_over_shared_memory_into_a_tp_decode_worker(ctx):
    """Both ranks write their heads in place into D's two rank pools, each on its own sender."""
    full = torch.randn(L, 2, 8, BS, H, D)
    segments = [SharedTensor.create((L, 2, N, BS, 1, D), torch.float32) for _ in range(2)]
    try:
        dst = [HeadShard(r, r + 1, t.tensor, t.name) for r, t in enumerate(segments) if t.tensor is not None]
        pools = [ShmPool(t.name, r, r + 1) for r, t in enumerate(segments)]
        layout = KvLayout(L, N, BS, H, D, "float32")
        leases = LeaseTable(L)
        with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", dst[0].pool, leases, rank_pools=dst) as rx:
            lease = leases.grant("r", DST, ttl_s=30)
            rank0, rank1 = (ShmKvSender(AUTH, rx.addr, pools[0].name, layout, pools=pools, ctx=ctx) for _ in range(2))
            rank1.send_range_done("r", lease.epoch, (1, 2), send_heads(rank1, lease, full, 1))
            rank0.send_done(done(lease, send_heads(rank0, lease, full, 0)))
            assert [d.request_id for d in poll_for(rx, 5)] == ["r"] and not rx.dropped
            rank0.close()
            rank1.close()
        for s in dst:
            assert torch.equal(s.pool[:, :, DST], full[:, :, SRC][:, :, :, :, s.start : s.end])
    finally:
        for t in segments:
            t.close()


@pytest.mark.parametrize("fault", ["missing_layer", "bytes", "missing_range"])
def test_a_rank_stream_short_of_its_kv_fails_the_request_at_once(ctx, fault):
    """Rank 1 done with a layer missing (its marker honest), with a byte count that is not what
    arrived, or rank 0 claiming one stream too few (rank 1's heads never sent): refused at once."""
    full = torch.randn(L, 2, 8, BS, H, D)
    pool = torch.zeros(L, 2, N, BS, H, D)
    leases = LeaseTable(L)
    with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", pool, leases) as rx:
        lease = leases.grant("r", DST, ttl_s=30)
        rank0, rank1 = ZmqKvSender(ctx, AUTH, rx.addr), ZmqKvSender(ctx, AUTH, rx.addr)
        if fault == "missing_range":
            rank0.send_done(done(lease, send_heads(rank0, lease, full, 0), range_dones=0))
        else:
            sent = send_heads(rank1, lease, full, 1, range(L - 1) if fault == "missing_layer" else range(L))
            rank1.send_range_done("r", lease.epoch, (1, 2), sent + (4 if fault == "bytes" else 0))
            rank0.send_done(done(lease, send_heads(rank0, lease, full, 0)))
        assert poll_for(rx, 5) == []
        want = {"missing_layer": "incomplete", "bytes": "bytes_mismatch", "missing_range": "incomplete"}[fault]
        assert [(d.request_id, why) for d, why in rx.failed_done] == [("r", want)]
        rank0.close()
        rank1.close()


def test_a_replayed_rank_marker_or_frame_is_refused(ctx):
    """Sequence numbers are per head range: rank 1's stream starts at 0 again without clashing
    with rank 0's; a replayed frame or a second marker for a range is dropped."""
    full = torch.randn(L, 2, 8, BS, H, D)
    pool = torch.zeros(L, 2, N, BS, H, D)
    leases = LeaseTable(L)
    with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", pool, leases) as rx:
        lease = leases.grant("r", DST, ttl_s=30)
        rank0, rank1, replay = (ZmqKvSender(ctx, AUTH, rx.addr) for _ in range(3))
        sent1 = send_heads(rank1, lease, full, 1)
        rank1.send_range_done("r", lease.epoch, (1, 2), sent1)
        assert poll_for(rx, 0.5) == [] and rx.frames_received == L
        send_heads(replay, lease, full, 1, range(1))  # seq 0 of range [1, 2) again
        replay.send_range_done("r", lease.epoch, (1, 2), sent1)
        assert poll_for(rx, 0.5) == [] and dict(rx.dropped) == {"duplicate": 2}
        rank0.send_done(done(lease, send_heads(rank0, lease, full, 0)))
        assert [d.request_id for d in poll_for(rx, 5)] == ["r"]
        assert dict(rx.dropped) == {"duplicate": 2} and rx.frames_received == 2 * L
        for s in (rank0, rank1, replay):
            s.close()
