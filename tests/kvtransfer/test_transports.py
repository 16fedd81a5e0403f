"""Each transport lands exactly the leased blocks, bit for bit; bad frames are dropped and counted."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from pdserve.kvtransfer import sender as sender_module
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import KvSendError, LeaseExpired, ShmKvSender, ZmqKvSender, make_kv_sender
from pdserve.kvtransfer.sender_cache import KvSenderCache
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.kvtransfer.wire import KvFrameHeader, decode_kv, encode_kv
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.channel import Outbox
from pdserve.protocol.messages import Abort, KvDestination, KvDone, KvLayout, Lease

L, N, BS, H, D = 3, 12, 4, 2, 8
BLOCK_BYTES = 2 * BS * H * D * 4
# The frame layer's checks, on links in clear: their drains wait fixed times, and a CURVE handshake
# per new connection (the default over tcp) made one miss a frame on a loaded machine. Encrypted
# KV links: tests/protocol/test_plane_encryption.py.
AUTH = FrameAuth(b"k" * 32, encryption="off")


@pytest.fixture
def pool():
    shared = SharedTensor.create((L, 2, N, BS, H, D), torch.float32)  # the decode worker's pool
    shared.tensor.fill_(-1.0)
    yield shared
    shared.close()


def drain(receiver, want: int = 1, timeout_s: float = 5.0, settle_s: float = 0.0):
    done, deadline = [], time.monotonic() + timeout_s
    while len(done) < want and time.monotonic() < deadline:
        done += receiver.poll(50)
    if settle_s:
        time.sleep(settle_s)
        done += receiver.poll(100)
    return done


def untouched(dst, leased):
    others = [b for b in range(dst.shape[2]) if b not in leased]
    return bool((dst[:, :, others] == -1).all())


@pytest.mark.parametrize("transport,bind", [("zmq", "tcp"), ("zmq", "ipc"), ("shm", "ipc"), ("shm", "tcp")])
def test_transport_lands_leased_blocks_exactly(ctx, tmp_path, pool, transport, bind):
    bind = f"ipc://{tmp_path}/kv.sock" if bind == "ipc" else "tcp://127.0.0.1:0"
    dst = pool.tensor
    leases = LeaseTable(L)
    with KvReceiver(ctx, AUTH, bind, dst, leases) as receiver:
        src = torch.randn(L, 2, 20, BS, H, D)  # the prefill worker's own pool
        src_blocks, dst_blocks = [7, 3, 11, 12], [5, 0, 9, 10]
        lease = leases.grant("r1", dst_blocks, ttl_s=30)
        sender = make_kv_sender(
            transport,
            ctx=ctx,
            auth=AUTH,
            kv_addr=receiver.addr,
            shm_name=pool.name,
            layout=KvLayout(L, N, BS, H, D, "float32"),
        )
        try:
            sent = sum(sender.send_layer("r1", lease, layer, src[layer], src_blocks, dst_blocks) for layer in range(L))
            assert sender.send_done(KvDone(request_id="r1", lease_epoch=lease.epoch, num_layers=L, kv_bytes=sent))
            done = drain(receiver)
        finally:
            sender.close()
        assert [d.request_id for d in done] == ["r1"]
        assert receiver.bytes_received == sent == L * len(dst_blocks) * BLOCK_BYTES
        assert not receiver.dropped
        for s, d in zip(src_blocks, dst_blocks):
            assert torch.equal(dst[:, :, d], src[:, :, s])
        assert untouched(dst, dst_blocks)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_zmq_half_precision_and_chunked_frames(ctx, dtype):
    dst = torch.full((L, 2, N, BS, H, D), -1.0, dtype=dtype)
    leases = LeaseTable(L)
    with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", dst, leases) as receiver:
        src = torch.randn(L, 2, 9, BS, H, D).to(dtype)
        lease = leases.grant("r", [2, 3, 4, 8, 1], ttl_s=30)
        # tiny frames: each layer goes as several messages; then a "second chunk" re-sends block 4
        sender = ZmqKvSender(ctx, AUTH, receiver.addr, max_frame_bytes=2 * BS * H * D * 2 * 2)
        try:
            for layer in range(L):
                sender.send_layer("r", lease, layer, src[layer], [0, 1, 2], [2, 3, 4])
            for layer in range(L):
                sender.send_layer("r", lease, layer, src[layer], [2, 5, 6], [4, 8, 1])
            sender.send_done(KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=L))
            assert [d.request_id for d in drain(receiver)] == ["r"]
        finally:
            sender.close()
        assert receiver.frames_received > 2 * L
        for s, d in zip([0, 1, 2, 5, 6], [2, 3, 4, 8, 1]):
            assert torch.equal(dst[:, :, d], src[:, :, s])
        assert untouched(dst, [2, 3, 4, 8, 1])


def test_bad_frames_are_dropped_and_the_receiver_keeps_going(ctx, pool):
    dst = pool.tensor
    leases = LeaseTable(L)
    with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", dst, leases) as receiver, Outbox(ctx, AUTH, receiver.addr) as raw:
        sender = ZmqKvSender(ctx, AUTH, receiver.addr)
        src = torch.ones(L, 2, 4, BS, H, D)
        lease = leases.grant("r1", [1, 2], ttl_s=30)
        ep = lease.epoch
        try:
            sender.send_layer("r1", ep - 1, 0, src[0], [0, 1], [1, 2])  # an older epoch
            sender.send_layer("nobody", ep, 0, src[0], [0, 1], [1, 2])  # no such lease
            sender.send_layer("r1", ep, 0, src[0], [0, 1], [3, 4])  # blocks not leased
            sender.send_layer("r1", ep, L, src[0], [0, 1], [1, 2])  # no such layer
            good = dict(
                request_id="r1",
                lease_epoch=ep,
                layer=0,
                block_ids=[1, 2],
                kv_head_start=0,
                kv_head_end=H,
                dtype="float32",
                shape=[2, 2, BS, H, D],
                nbytes=2 * BLOCK_BYTES,
            )
            payload = torch.full((2, 2, BS, H, D), 5.0).numpy().tobytes()
            raw.send(KvFrameHeader(**{**good, "dtype": "float16"}, seq=100), [payload])
            raw.send(KvFrameHeader(**{**good, "kv_head_end": H + 1}, seq=101), [payload])
            raw.send(KvFrameHeader(**{**good, "shape": [2, 1, BS, H, D]}, seq=102), [payload])
            raw.send(KvFrameHeader(**{**good, "nbytes": 99}, seq=103), [payload])
            raw.send(KvFrameHeader(**good, seq=104), [payload[:-4]])  # payload shorter than the header says
            raw.send(KvFrameHeader(**good, seq=105), [payload, payload])
            raw.send(Abort(request_id="r1"))  # a control message on the KV stream
            other = FrameAuth(b"x" * 32)  # another cluster's secret
            raw.socket.send_multipart(other.sign(encode_kv(KvFrameHeader(**good, seq=106)), [payload]))
            sender.send_layer("r1", lease, 0, src[0], [0, 1], [1, 2])  # good, but only layer 0 (seq 2)
            raw.send(KvFrameHeader(**good, seq=2), [payload])  # replay of that frame's seq
            sender.send_done(KvDone(request_id="r1", lease_epoch=ep, num_layers=L))
            assert drain(receiver, timeout_s=1.0, settle_s=0.2) == []
        finally:
            sender.close()
        assert dict(receiver.dropped) == {
            "stale_epoch": 1,
            "unknown_lease": 1,
            "blocks_not_leased": 1,
            "bad_layer": 1,
            "layout_mismatch": 2,
            "size_mismatch": 4,
            "decode": 1,
            "auth": 1,
            "duplicate": 1,
            "incomplete": 1,
        }
        assert untouched(dst, [1, 2]) and bool((dst[0, :, [1, 2]] == 1).all())  # only the good frame landed
        # still serving: finish the request properly
        sender = ZmqKvSender(ctx, AUTH, receiver.addr)
        try:
            # a new sender numbers frames from 0 again, which this lease has seen: refused
            sender.send_layer("r1", lease, 1, src[1], [0, 1], [1, 2])
            drain(receiver, timeout_s=0.5, settle_s=0.1)
            assert receiver.dropped["duplicate"] == 2
        finally:
            sender.close()
        lease2 = leases.grant("r2", [6], ttl_s=30)
        sender = ZmqKvSender(ctx, AUTH, receiver.addr)
        try:
            for layer in range(L):
                sender.send_layer("r2", lease2, layer, src[layer], [3], [6])
            sender.send_done(KvDone(request_id="r2", lease_epoch=lease2.epoch, num_layers=L))
            assert [d.request_id for d in drain(receiver)] == ["r2"]
        finally:
            sender.close()


def test_expired_lease_frames_dropped_by_receiver(ctx, pool):
    leases = LeaseTable(L)
    with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", pool.tensor, leases) as receiver:
        lease = leases.grant("r", [3], ttl_s=0.05)
        sender = ZmqKvSender(ctx, AUTH, receiver.addr)
        try:
            time.sleep(0.1)
            # P does not know the deadline (epoch only): D's check is what stops the write
            sender.send_layer("r", lease.epoch, 0, torch.ones(2, 4, BS, H, D), [0], [3])
            drain(receiver, timeout_s=0.5, settle_s=0.1)
        finally:
            sender.close()
        assert receiver.dropped == {"expired": 1}
        assert untouched(pool.tensor, [])


def test_senders_refuse_after_the_deadline(ctx, pool):
    layout = KvLayout(L, N, BS, H, D, "float32")
    src = torch.ones(2, 4, BS, H, D)
    with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", pool.tensor, LeaseTable(L)) as receiver:
        shm = ShmKvSender(AUTH, receiver.addr, pool.name, layout, ctx=ctx, deadline_margin_s=0.1)
        zs = ZmqKvSender(ctx, AUTH, receiver.addr)
        try:
            past = Lease(epoch=1, block_ids=[2], deadline=time.time() - 0.01)
            almost = Lease(epoch=1, block_ids=[2], deadline=time.time() + 0.05)  # inside the margin
            for lease in (past, almost):
                with pytest.raises(LeaseExpired):
                    shm.send_layer("r", lease, 0, src, [0], [2])
            with pytest.raises(LeaseExpired):
                shm.send_layer("r", 1, 0, src, [0], [2], deadline=time.time() - 1)
            with pytest.raises(ValueError, match="deadline"):
                shm.send_layer("r", 1, 0, src, [0], [2])  # an epoch alone is not enough for shm
            with pytest.raises(LeaseExpired):
                zs.send_layer("r", past, 0, src, [0], [2])
            ok = Lease(epoch=1, block_ids=[2], deadline=time.time() + 30)
            with pytest.raises(ValueError, match="lease"):
                shm.send_layer("r", ok, 0, src, [0], [3])  # not a leased block: never written
            with pytest.raises(ValueError):
                shm.send_layer("r", ok, 0, src[:, :, :2], [0], [2])  # wrong block shape
        finally:
            shm.close()
            zs.close()
        assert untouched(pool.tensor, [])


def test_sender_cache_keeps_one_open_sender_per_destination(ctx, pool):
    layout = KvLayout(L, N, BS, H, D, "float32")
    with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", pool.tensor, LeaseTable(L)) as receiver:

        def dest(transport: str, epoch: int, worker_id: str = "d") -> KvDestination:
            lease = Lease(epoch=epoch, block_ids=[1], deadline=time.time() + 30)
            return KvDestination(worker_id, receiver.addr, pool.name, transport, lease, layout)  # type: ignore[arg-type]

        senders = KvSenderCache(ctx, FrameAuth(b"k" * 32, encryption="auto"), "auto")
        try:
            a, b = senders.get(dest("zmq", 1)), senders.get(dest("zmq", 2, "other-name"))
            s = senders.get(dest("shm", 3))
            assert a is b and s is not a and s.transport == "shm" and len(senders) == 2
            assert not a.payload_mac  # auto: a CURVE-encrypted tcp link needs no payload MAC
            in_clear = KvSenderCache(ctx, AUTH, "auto")
            assert in_clear.get(dest("zmq", 5)).payload_mac  # ... an unencrypted one does
            in_clear.close()
            a.close()
            c = senders.get(dest("zmq", 4))
            assert c is not a and not c.closed and len(senders) == 2
        finally:
            senders.close()
        assert c.closed and s.closed and len(senders) == 0
        with pytest.raises(ValueError):
            make_kv_sender("shm", ctx=ctx, auth=AUTH, kv_addr=receiver.addr, shm_name=None, layout=layout)
        with pytest.raises(ValueError):
            make_kv_sender("carrier-pigeon", ctx=ctx, auth=AUTH, kv_addr=receiver.addr)
        with pytest.raises(ValueError):
            KvSenderCache(ctx, AUTH, "sometimes")


def test_wire_roundtrip_and_tags():
    h = KvFrameHeader(
        request_id="r",
        lease_epoch=2**61,
        layer=1,
        block_ids=[3],
        kv_head_start=0,
        kv_head_end=4,
        dtype="float32",
        shape=[2, 1, 16, 4, 64],
        nbytes=32768,
        seq=7,
    )
    assert decode_kv(encode_kv(h)) == h
    done = KvDone(request_id="r", lease_epoch=5, num_layers=8)
    assert decode_kv(encode_kv(done)) == done
    with pytest.raises(msgspec.ValidationError):
        decode_kv(encode_kv(Abort(request_id="r")))  # not a KV-stream message


def test_zmq_staging_ring_isolates_the_source_and_bounds_frames_in_flight(ctx, tmp_path):
    big = (64, 8, 64)  # 256 KiB per block: above pyzmq's copy threshold, so frames really are zero-copy
    dst = torch.full((L, 2, N, *big), -1.0)
    leases = LeaseTable(L)
    with KvReceiver(ctx, AUTH, f"ipc://{tmp_path}/kv.sock", dst, leases) as receiver:
        sender = ZmqKvSender(ctx, AUTH, receiver.addr, ring_size=2)
        try:
            src = torch.randn(L, 2, 6, *big)
            want = src.clone()
            lease = leases.grant("r", [1, 4, 6], ttl_s=30)
            for layer in range(L):  # more frames than staging buffers
                sender.send_layer("r", lease, layer, src[layer], [5, 0, 2], [1, 4, 6])
                src[layer].fill_(float("nan"))  # P reuses its blocks at once: D must not see it
            sender.send_done(KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=L))
            assert [d.request_id for d in drain(receiver)] == ["r"]
        finally:
            sender.close()
        for s, d in zip([5, 0, 2], [1, 4, 6]):
            assert torch.equal(dst[:, :, d], want[:, :, s])
    # nobody reads: the ring's frames never leave, so the next layer fails after the timeout
    # (frames above pyzmq's copy threshold; smaller ones are copied and free their buffer at once)
    stuck = ZmqKvSender(ctx, AUTH, f"ipc://{tmp_path}/nobody.sock", ring_size=2, send_timeout_ms=100)
    try:
        src = torch.randn(2, 4, 64, 8, 64)  # 256 KiB per block
        stuck.send_layer("r", 1, 0, src, [0], [0])
        stuck.send_layer("r", 1, 1, src, [1], [1])
        t0 = time.monotonic()
        with pytest.raises(KvSendError):
            stuck.send_layer("r", 1, 2, src, [2], [2])
        assert time.monotonic() - t0 < 2.0
    finally:
        stuck.close()


def test_writer_release_returns_blocks_at_once_active_or_quarantined():
    leases = LeaseTable(L)
    a = leases.grant("a", [1, 2], ttl_s=30)
    b = leases.grant("b", [3], ttl_s=30)
    assert leases.release_early("a", a.epoch - 1) == []  # wrong epoch: nothing
    assert sorted(leases.release_early("a", a.epoch)) == [1, 2]  # still active
    assert leases.revoke("b") and leases.reclaimable() == []  # quarantined until the deadline
    assert leases.release_early("b", b.epoch) == [3]  # the writer's promise frees it now
    assert leases.release_early("b", b.epoch) == [] and leases.reclaimable(time.time() + 60) == []


def test_shm_block_runs_by_address_over_chunks_of_one_request(ctx, pool, monkeypatch):
    """ShmKvSender copies runs of consecutive blocks by address (`_copy_runs_flat`), planning a
    chunk's ids once for all its layers: a request's second chunk (other ids, the same lease) and a
    scattered chunk of another request land bit for bit, every other block untouched."""
    by_address = []
    flat = sender_module._copy_runs_flat
    monkeypatch.setattr(sender_module, "_copy_runs_flat", lambda *a: (by_address.append(a[1]), flat(*a)))
    dst = pool.tensor
    leases = LeaseTable(L)
    with KvReceiver(ctx, AUTH, "tcp://127.0.0.1:0", dst, leases) as receiver:
        src = torch.randn(L, 2, 20, BS, H, D)
        chunks = [([2, 3, 4], [1, 2, 3]), ([5, 6, 7, 8], [4, 5, 6, 7])]  # runs of 3 and 4 blocks
        scattered = ([19, 0, 15], [11, 0, 9])
        lease = leases.grant("r1", [b for _, ids in chunks for b in ids], ttl_s=30)
        other = leases.grant("r2", scattered[1], ttl_s=30)
        sender = ShmKvSender(AUTH, receiver.addr, pool.name, KvLayout(L, N, BS, H, D, "float32"), ctx=ctx)
        try:
            sent = {"r1": 0, "r2": 0}
            for s_ids, d_ids in chunks:
                for layer in range(L):  # interleaved with the other request, as a batched step sends
                    sent["r1"] += sender.send_layer("r1", lease, layer, src[layer], s_ids, d_ids)
                    if s_ids == chunks[0][0]:
                        sent["r2"] += sender.send_layer("r2", other, layer, src[layer], *scattered)
            for rid, ls in (("r1", lease), ("r2", other)):
                assert sender.send_done(KvDone(request_id=rid, lease_epoch=ls.epoch, num_layers=L, kv_bytes=sent[rid]))
            done = drain(receiver, want=2)
        finally:
            sender.close()
        assert sorted(d.request_id for d in done) == ["r1", "r2"] and not receiver.dropped
        pairs = [p for s_ids, d_ids in (*chunks, scattered) for p in zip(s_ids, d_ids)]
        for s, d in pairs:
            assert torch.equal(dst[:, :, d], src[:, :, s])
        assert untouched(dst, [d for _, d in pairs])
        assert not sender._plans  # forgotten with each KvDone
        assert by_address == [*range(L), *range(L)]  # r1's two chunks; r2's scattered ids went by copy_blocks
