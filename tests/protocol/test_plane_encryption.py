"""The worker and KV planes encrypted with CURVE: bytes on a tcp link hold nothing in clear, a
peer without the cluster secret delivers nothing, and the mode rule both ends apply."""

from __future__ import annotations

import socket
import threading

import pytest
import torch
import zmq

from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.sender import ZmqKvSender
from pdserve.protocol import plane_encryption
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.channel import Inbox, Outbox
from pdserve.protocol.messages import Abort, KvDone

pytestmark = pytest.mark.skipif(not plane_encryption.available(), reason="libzmq without CURVE")

SECRET = b"s" * 32
MARKER = "prompt-text-that-must-not-travel-in-clear"


class SnoopingProxy(threading.Thread):
    """A TCP hop that forwards bytes both ways and keeps a copy of all it saw (a link capture)."""

    def __init__(self, upstream_port: int) -> None:
        super().__init__(daemon=True)
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.seen = bytearray()
        self.lock = threading.Lock()

    def run(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self.lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass

    def captured(self) -> bytes:
        with self.lock:
            return bytes(self.seen)

    def close(self) -> None:
        self.listener.close()


def _port(addr: str) -> int:
    return int(addr.rsplit(":", 1)[1])


@pytest.mark.parametrize("mode", ["auto", "off"])
def test_a_tcp_link_carries_no_message_or_kv_bytes_in_clear_unless_encryption_is_off(ctx, mode):
    auth = FrameAuth(SECRET, encryption=mode)
    kv = torch.zeros(1, 2, 4, 4, 2, 8)  # [L, 2, N, bs, Hkv, D] the decode side's pool
    src = torch.arange(2 * 4 * 4 * 2 * 8, dtype=torch.float32).view(2, 4, 4, 2, 8) + 1000.0  # [2, N, bs, Hkv, D]
    leases = LeaseTable(1)
    with Inbox(ctx, auth, "tcp://127.0.0.1:0") as inbox, KvReceiver(ctx, auth, "tcp://127.0.0.1:0", kv, leases) as rx:
        proxies = [SnoopingProxy(_port(inbox.addr)), SnoopingProxy(_port(rx.addr))]
        for p in proxies:
            p.start()
        out = Outbox(ctx, auth, f"tcp://127.0.0.1:{proxies[0].port}")
        sender = ZmqKvSender(ctx, auth, f"tcp://127.0.0.1:{proxies[1].port}")
        try:
            assert out.send(Abort(request_id=MARKER, reason=MARKER))
            assert inbox.recv_one(5000) == Abort(request_id=MARKER, reason=MARKER)  # delivered intact
            lease = leases.grant("r", [0, 1], ttl_s=30)
            sent = sender.send_layer("r", lease, 0, src, [0, 1], [0, 1])
            sender.send_done(KvDone(request_id="r", lease_epoch=lease.epoch, num_layers=1, kv_bytes=sent))
            done: list = []
            for _ in range(100):
                done += rx.poll(50)
                if done:
                    break
            assert [d.request_id for d in done] == ["r"] and torch.equal(kv[0, :, :2], src[:, :2])
        finally:
            out.close()
            sender.close()
            for p in proxies:
                p.close()
        message_link, kv_link = (p.captured() for p in proxies)
        kv_bytes = src[:, :2].contiguous().numpy().tobytes()
        in_clear = MARKER.encode() in message_link, kv_bytes[:256] in kv_link
        assert in_clear == ((False, False) if mode == "auto" else (True, True))


def test_a_peer_without_the_secret_delivers_nothing(ctx):
    auth = FrameAuth(SECRET, encryption="auto")
    with Inbox(ctx, auth, "tcp://127.0.0.1:0") as inbox:
        plain = ctx.socket(zmq.PUSH)  # no CURVE at all: the handshake never completes
        other = ctx.socket(zmq.PUSH)  # CURVE keys of another cluster's secret
        FrameAuth(b"x" * 32, encryption="auto").secure_connect(other, inbox.addr)
        for sock in (plain, other):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(inbox.addr)
            sock.send_multipart(auth.sign(b"anything"), flags=zmq.NOBLOCK)  # (even correctly signed)
        try:
            assert inbox.recv_one(1000) is None and not inbox.dropped  # never reached the inbox
            with Outbox(ctx, auth, inbox.addr) as member:
                assert member.send(Abort(request_id="member"))
                assert inbox.recv_one(5000) == Abort(request_id="member")
        finally:
            plain.close()
            other.close()


def test_which_sockets_encrypt():
    rule = plane_encryption.encrypts
    assert [rule("auto", a) for a in ("tcp://10.0.0.5:7100", "tcp://127.0.0.1:1", "ipc:///x", "inproc://y")] == [
        True,
        True,
        False,
        False,
    ]
    assert [rule("on", a) for a in ("tcp://h:1", "ipc:///x", "inproc://y")] == [True, True, False]
    assert not rule("off", "tcp://10.0.0.5:7100")
    with pytest.raises(ValueError):
        FrameAuth(SECRET, encryption="maybe")


def test_keys_come_from_the_secret():
    a, b = plane_encryption.curve_keys(SECRET), plane_encryption.curve_keys(b"t" * 32)
    assert a == plane_encryption.curve_keys(bytes(SECRET))  # every process derives the same
    assert a.server_public != b.server_public and a.client_secret != b.client_secret
    assert a.server_public == zmq.curve_public(a.server_secret) and len(a.server_public) == 40
