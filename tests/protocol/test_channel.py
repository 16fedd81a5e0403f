"""Channels: typed round trips, hostile input dropped and counted, loopback-only binds, no hangs."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.channel import AsyncInbox, AsyncOutbox, Inbox, Outbox, check_bind_address
from pdserve.protocol.messages import Abort, Heartbeat, TokenOutput, WorkerStats, encode

AUTH = FrameAuth(b"s" * 32)
# Pickles as raw bytes (nothing here ever unpickles): a dict, and the classic os.system gadget.
PICKLE_DICT = b"\x80\x04\x95\n\x00\x00\x00\x00\x00\x00\x00}\x94\x8c\x01a\x94K\x01s."
PICKLE_GADGET = b"cos\nsystem\n(S'echo pwned'\ntR."


@pytest.fixture(params=["tcp", "ipc"])
def bind_addr(request, tmp_path):
    return "tcp://127.0.0.1:0" if request.param == "tcp" else f"ipc://{tmp_path}/inbox.sock"


def test_roundtrip_resolves_address(ctx, bind_addr):
    with Inbox(ctx, AUTH, bind_addr) as inbox, Outbox(ctx, AUTH, inbox.addr) as out:
        if bind_addr.startswith("tcp"):
            assert inbox.addr.startswith("tcp://127.0.0.1:") and not inbox.addr.endswith(":0")
        msgs = [
            Abort(request_id="r1", reason="x"),
            Heartbeat(worker_id="w", stats=WorkerStats(kv_blocks_free=3)),
            TokenOutput(request_id="r1", token_ids=[1, 2, 3], timings={"a": 0.5}),
        ]
        for m in msgs:
            assert out.send(m)
        got = [inbox.recv_one(2000) for _ in msgs]
        assert got == msgs
        assert inbox.recv_one(0) is None
        assert out.send(Abort(request_id="p"), payloads=[b"raw bytes"])
        msg, payloads = inbox.recv_raw(2000)
        assert msg == Abort(request_id="p") and [bytes(p) for p in payloads] == [b"raw bytes"]


def test_default_bind_is_loopback(ctx):
    with Inbox(ctx, AUTH) as inbox:
        assert inbox.addr.startswith("tcp://127.0.0.1:")


def test_hostile_frames_are_dropped_counted_and_receiving_goes_on(ctx):
    with Inbox(ctx, AUTH, "tcp://127.0.0.1:0") as inbox:
        raw = ctx.socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        try:
            AUTH.secure_connect(raw, inbox.addr)  # a peer that passed the CURVE handshake (an insider)
            raw.connect(inbox.addr)
            good = Abort(request_id="ok")
            raw.send_multipart([b"garbage"])  # one frame
            raw.send_multipart([b"\x00" * 32, encode(good)])  # forged mac
            raw.send_multipart(FrameAuth(b"w" * 32).sign(encode(good)))  # wrong secret
            raw.send_multipart([PICKLE_DICT, PICKLE_GADGET])  # pickles, unsigned
            raw.send_multipart(AUTH.sign(PICKLE_GADGET))  # pickle, signed by an insider: still no
            raw.send_multipart(AUTH.sign(PICKLE_DICT))
            raw.send_multipart(AUTH.sign(b"\xc1\xff\x00"))  # not msgpack
            raw.send_multipart(AUTH.sign(msgspec.msgpack.encode({"type": "Nope", "x": 1})))  # unknown tag
            raw.send_multipart(AUTH.sign(msgspec.msgpack.encode({"type": "Abort", "request_id": 5})))  # bad type
            raw.send_multipart(AUTH.sign(encode(good)))
            assert inbox.recv_one(3000) == good  # the bad ones before it were skipped, not fatal
            assert inbox.dropped == {"auth": 4, "decode": 5}
            raw.send_multipart(AUTH.sign(encode(Abort(request_id="again"))))
            assert inbox.recv(2000) == [Abort(request_id="again")]
        finally:
            raw.close(linger=0)


def test_wildcard_binds_refused_unless_allowed(ctx):
    for addr in ("tcp://*:0", "tcp://0.0.0.0:0", "tcp://[::]:0", "tcp://:5555", "tcp://*"):
        with pytest.raises(ValueError, match="wildcard"):
            check_bind_address(addr)
        check_bind_address(addr, allow_wildcard=True)
        with pytest.raises(ValueError, match="wildcard"):
            Inbox(ctx, AUTH, addr)
    for addr in ("tcp://127.0.0.1:0", "tcp://[::1]:0", "ipc:///tmp/x.sock", "inproc://x"):
        check_bind_address(addr)
    with pytest.raises(ValueError):
        check_bind_address("127.0.0.1:5555")


def test_full_queue_returns_false_instead_of_blocking(ctx, tmp_path):
    # Nobody listens on this address: messages queue up to SNDHWM, then send reports "full".
    with Outbox(ctx, AUTH, f"ipc://{tmp_path}/nobody.sock", sndhwm=4) as out:
        t0 = time.monotonic()
        results = [out.send(Abort(request_id=str(i))) for i in range(50)]
        assert results[0] and not all(results) and out.full > 0
        assert not out.send(Abort(request_id="t"), timeout_ms=50)
        assert time.monotonic() - t0 < 2.0


def test_async_twins(tmp_path):
    async def main():
        actx = zmq.asyncio.Context()
        inbox = AsyncInbox(actx, AUTH, f"ipc://{tmp_path}/a.sock")
        out = AsyncOutbox(actx, AUTH, inbox.addr)
        raw = actx.socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        try:
            raw.connect(inbox.addr)
            await raw.send_multipart([b"junk", b"junk"])
            assert out.send(Abort(request_id="a1"))  # synchronous, non-blocking
            assert await out.send_async(Abort(request_id="a2"), timeout_ms=1000)
            assert await inbox.recv_one(3000) == Abort(request_id="a1")
            assert await inbox.recv_one(3000) == Abort(request_id="a2")
            assert inbox.dropped["auth"] == 1
            assert await inbox.recv_one(50) is None
        finally:
            raw.close(linger=0)
            out.close()
            inbox.close()
            actx.term()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_each_inbox_decodes_only_its_own_channel(ctx):
    from pdserve.protocol.messages import Welcome, decode_to_gateway, decode_to_worker

    out = TokenOutput(request_id="r", token_ids=[1])
    assert decode_to_gateway(encode(out)) == out
    with pytest.raises(msgspec.ValidationError):
        decode_to_worker(encode(out))  # a worker is never sent tokens
    welcome = Welcome(gateway_id="g", inbox_addr="ipc:///x")
    assert decode_to_worker(encode(welcome)) == welcome
    with pytest.raises(msgspec.ValidationError):
        decode_to_gateway(encode(welcome))
    with pytest.raises(msgspec.ValidationError):  # required fields are required on the wire too
        decode_to_worker(msgspec.msgpack.encode({"type": "Abort", "reason": "x"}))
    inbox = Inbox(ctx, AUTH, "tcp://127.0.0.1:0", decoder=decode_to_worker)
    box = Outbox(ctx, AUTH, inbox.addr)
    try:
        assert box.send(out) and box.send(Abort(request_id="r"))
        got = inbox.recv(timeout_ms=2000)
        deadline = time.monotonic() + 2
        while not got and time.monotonic() < deadline:
            got = inbox.recv(timeout_ms=100)
        assert [type(m).__name__ for m in got] == ["Abort"]  # the TokenOutput was dropped
        assert sum(inbox.dropped.values()) == 1
    finally:
        box.close()
        inbox.close()
