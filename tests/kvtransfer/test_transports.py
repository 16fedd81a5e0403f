"""Each transport lands exactly the leased blocks, bit for bit; bad frames are dropped."""
from __future__ import annotations

import time

import pytest
import torch
import zmq

from kvtransfer.lease import LeaseTable
from kvtransfer.receiver import KvReceiver
from kvtransfer.sender import LeaseExpired, make_kv_sender
from kvtransfer.shm import SharedTensor
from protocol.auth import FrameAuth
from protocol.messages import KvDone, KvLayout

L, N, BS, H, D = 3, 12, 4, 2, 8
AUTH = FrameAuth(b"k" * 32)


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def drain(receiver, want: int = 1, timeout_s: float = 5.0):
    done, deadline = [], time.monotonic() + timeout_s
    while len(done) < want and time.monotonic() < deadline:
        done += receiver.poll(50)
    return done


@pytest.mark.parametrize("transport,bind", [("zmq", "tcp://127.0.0.1:0"), ("zmq", "ipc"), ("shm", "ipc")])
def test_transport_lands_leased_blocks_exactly(ctx, tmp_path, transport, bind, dtype=torch.float32):
    bind = f"ipc://{tmp_path}/kv.sock" if bind == "ipc" else bind
    shared = SharedTensor.create((L, 2, N, BS, H, D), dtype)
    try:
        dst = shared.tensor
        dst.fill_(-1.0)
        leases = LeaseTable(L)
        receiver = KvReceiver(ctx, AUTH, bind, dst, leases)
        src = torch.randn(L, 2, 20, BS, H, D)  # the prefill worker's own pool
        src_blocks, dst_blocks = [7, 3, 11], [5, 0, 9]
        lease = leases.grant("r1", dst_blocks, ttl_s=30)
        layout = KvLayout(L, N, BS, H, D, "float32")
        sender = make_kv_sender(transport, ctx=ctx, auth=AUTH, kv_addr=receiver.addr,
                                shm_name=shared.name, layout=layout)
        sent = sum(sender.send_layer("r1", lease, layer, src[layer], src_blocks, dst_blocks)
                   for layer in range(L))
        sender.send_done(KvDone(request_id="r1", lease_epoch=lease.epoch, num_layers=L))
        done = drain(receiver)
        assert [d.request_id for d in done] == ["r1"]
        assert receiver.bytes_received == sent == L * 2 * 3 * BS * H * D * 4
        for s, d in zip(src_blocks, dst_blocks):
            assert torch.equal(dst[:, :, d], src[:, :, s])
        untouched = [b for b in range(N) if b not in dst_blocks]
        assert bool((dst[:, :, untouched] == -1).all())
        sender.close()
        receiver.close()
    finally:
        shared.close()


def test_stale_epoch_unknown_and_incomplete_are_dropped(ctx):
    dst = torch.zeros(L, 2, N, BS, H, D)
    leases = LeaseTable(L)
    receiver = KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", dst, leases)
    layout = KvLayout(L, N, BS, H, D, "float32")
    sender = make_kv_sender("zmq", ctx=ctx, auth=AUTH, kv_addr=receiver.addr, shm_name=None, layout=layout)
    src = torch.ones(L, 2, 4, BS, H, D)
    lease = leases.grant("r1", [1, 2], ttl_s=30)
    old = lease.__class__(epoch=lease.epoch - 1, block_ids=lease.block_ids, deadline=lease.deadline)
    sender.send_layer("r1", old, 0, src[0], [0, 1], [1, 2])  # replay of an older epoch
    sender.send_layer("nobody", lease, 0, src[0], [0, 1], [1, 2])  # no such lease
    sender.send_layer("r1", lease, 0, src[0], [0, 1], [3, 4])  # blocks not leased
    sender.send_layer("r1", lease, 0, src[0], [0, 1], [1, 2])  # good, but only layer 0
    sender.send_done(KvDone(request_id="r1", lease_epoch=lease.epoch, num_layers=L))
    time.sleep(0.3)
    assert receiver.poll(200) == []
    assert receiver.dropped["stale_epoch"] == 1
    assert receiver.dropped["unknown_lease"] == 1
    assert receiver.dropped["blocks_not_leased"] == 1
    assert receiver.dropped["incomplete"] == 1
    assert bool((dst[:, :, 3:5] == 0).all())
    sender.close()
    receiver.close()


def test_quarantine_until_deadline_and_expired_sender_refuses():
    leases = LeaseTable(L)
    lease = leases.grant("r1", [4, 5], ttl_s=0.2)
    assert leases.revoke("r1")
    assert leases.reclaimable() == []  # still inside the deadline: a late writer could exist
    time.sleep(0.25)
    assert sorted(leases.reclaimable()) == [4, 5]
    from kvtransfer.sender import ZmqKvSender
    with pytest.raises(LeaseExpired):
        ZmqKvSender._check_deadline(lease)
