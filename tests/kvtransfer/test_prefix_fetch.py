"""A prefix fetch between two workers' sockets (kvtransfer/prefix_exporter.py answers,
kvtransfer/prefix_fetcher.py asks), over loopback: the leading run the peer holds arrives intact;
another model or layout, a wrong secret, a bad payload tag, a peer that vanished or never answers
all end the fetch with nothing, quickly or at its deadline, never with wrong KV."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch

from pdserve.kvtransfer.prefix_exporter import PrefixExporter
from pdserve.kvtransfer.prefix_fetcher import FetchedPrefix, PoolShape, PrefixFetcher
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvLayout

SECRET = b"s" * 32
FINGERPRINT = "model-a"
LAYERS, BLOCKS, BS, HEADS, DIM = 3, 8, 4, 2, 8
LAYOUT = KvLayout(LAYERS, BLOCKS, BS, HEADS, DIM, "float32")
HASHES = [bytes([i]) * 16 for i in range(5)]


def pool(seed: int = 0) -> torch.Tensor:
    return torch.randn(LAYERS, 2, BLOCKS, BS, HEADS, DIM, generator=torch.Generator().manual_seed(seed))


class Holder:
    """A peer whose cache holds the first `held` of HASHES, in blocks 7, 6, 5 ..."""

    def __init__(self, held: int) -> None:
        self.kv = pool()
        self.blocks = [BLOCKS - 1 - i for i in range(held)]
        self.asked: list[list[bytes]] = []

    def read(self, hashes: list[bytes]) -> list[torch.Tensor]:
        self.asked.append(hashes)
        n = 0
        while n < len(hashes) and n < len(self.blocks) and hashes[n] == HASHES[n]:
            n += 1
        return [self.kv[:, :, self.blocks[:n]].contiguous()] if n else []


def fetcher(ctx, auth: FrameAuth | None = None, payload_mac: str = "auto") -> PrefixFetcher:
    shape = PoolShape.of(pool())
    return PrefixFetcher(ctx, auth or FrameAuth(SECRET), FINGERPRINT, LAYOUT, [shape], payload_mac=payload_mac)


def exporter(ctx, holder: Holder, auth: FrameAuth | None = None, **kw) -> PrefixExporter:
    kw.setdefault("payload_mac", False)
    fingerprint = kw.pop("fingerprint", FINGERPRINT)
    layout = kw.pop("layout", LAYOUT)
    return PrefixExporter(ctx, auth or FrameAuth(SECRET), "tcp://127.0.0.1:0", fingerprint, layout, holder.read, **kw)


def fetch(f: PrefixFetcher, ex: PrefixExporter | None, addr: str, hashes: list[bytes], timeout_s=5.0) -> FetchedPrefix:
    """Run one fetch, the exporter served as a worker's loop would, until it ends."""
    f.start("req-1", addr, hashes, timeout_s)
    deadline = time.monotonic() + timeout_s + 3
    while time.monotonic() < deadline:
        if ex is not None:
            ex.serve()
        done = f.collect()
        if done:
            return done[0]
        time.sleep(0.005)
    raise AssertionError("the fetch never ended")


def layer(result: FetchedPrefix, i: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(result.layers[i]), dtype=torch.float32).view(2, -1, BS, HEADS, DIM)


@pytest.mark.parametrize("payload_mac", ["off", "on"])
def test_the_leading_run_the_peer_holds_arrives_intact(ctx, payload_mac):
    holder = Holder(held=3)
    ex = exporter(ctx, holder)
    f = fetcher(ctx, payload_mac=payload_mac)
    try:
        got = fetch(f, ex, ex.addr, HASHES[:4])
        assert got.error is None and got.hashes == HASHES[:3] and len(got.layers) == LAYERS
        for i in range(LAYERS):
            assert torch.equal(layer(got, i), holder.kv[i][:, [7, 6, 5]])
        assert got.nbytes == LAYERS * 2 * 3 * BS * HEADS * DIM * 4
        assert (ex.stats.exports, ex.stats.blocks, ex.stats.bytes) == (1, 3, got.nbytes)
    finally:
        f.close()
        ex.close()


def test_a_peer_holding_none_another_model_or_layout_sends_nothing(ctx):
    f = fetcher(ctx)
    for holder, kw, why in [
        (Holder(held=0), {}, "none of the blocks held"),
        (Holder(held=3), {"fingerprint": "model-b"}, "another model"),
        (Holder(held=3), {"layout": msgspec.structs.replace(LAYOUT, dtype="bfloat16")}, "another model or KV layout"),
    ]:
        ex = exporter(ctx, holder, **kw)
        try:
            got = fetch(f, ex, ex.addr, HASHES)
            assert got.layers == [] and got.hashes == [] and why in (got.error or "")
            assert ex.stats.refused == 1 and ex.stats.exports == 0
        finally:
            ex.close()
    f.close()


def test_a_peer_with_another_secret_is_not_heard(ctx):
    """In clear, its request fails the exporter's frame MAC check (the fetch times out); over
    CURVE (tcp:// by default) the handshake fails (unreachable). Nothing is used either way."""
    ex = exporter(ctx, Holder(held=3), auth=FrameAuth(b"x" * 32, encryption="off"))
    f = fetcher(ctx, auth=FrameAuth(SECRET, encryption="off"))
    curve = exporter(ctx, Holder(held=3), auth=FrameAuth(b"x" * 32, encryption="on"))
    curved = fetcher(ctx, auth=FrameAuth(SECRET, encryption="on"))
    try:
        got = fetch(f, ex, ex.addr, HASHES, timeout_s=0.5)
        assert got.layers == [] and "timed out" in (got.error or "")
        assert ex.dropped["auth"] == 1 and ex.stats.exports == 0
        got = fetch(curved, curve, curve.addr, HASHES, timeout_s=0.5)
        assert got.layers == [] and got.error == "peer unreachable" and curve.stats.exports == 0
    finally:
        f.close()
        curved.close()
        ex.close()
        curve.close()


class BadTags(FrameAuth):
    """Frame MACs right, payload tags of other bytes (a payload modified in flight)."""

    def payload_mac(self, payload) -> bytes:
        return super().payload_mac(b"other bytes")


def test_a_payload_whose_tag_does_not_match_fails_the_whole_fetch(ctx):
    ex = exporter(ctx, Holder(held=3), auth=BadTags(SECRET))
    f = fetcher(ctx, payload_mac="on")
    try:
        got = fetch(f, ex, ex.addr, HASHES)
        assert got.layers == [] and got.hashes == [] and "payload MAC" in (got.error or "")
    finally:
        f.close()
        ex.close()


class ForgedReplies(FrameAuth):
    """Hears requests under the secret, signs its replies under another (a forger's frames)."""

    def sign(self, header: bytes, payloads=()) -> list:
        return FrameAuth(b"x" * 32, encryption="off").sign(header, payloads)


def test_replies_failing_their_frame_mac_fail_the_fetch(ctx):
    ex = exporter(ctx, Holder(held=3), auth=ForgedReplies(SECRET, encryption="off"))
    f = fetcher(ctx, auth=FrameAuth(SECRET, encryption="off"))
    try:
        got = fetch(f, ex, ex.addr, HASHES)
        assert got.layers == [] and got.hashes == [] and "frame MAC" in (got.error or "")
    finally:
        f.close()
        ex.close()


def test_a_peer_that_vanished_fails_fast_and_one_that_never_answers_at_the_deadline(ctx):
    ex = exporter(ctx, Holder(held=3))
    addr = ex.addr
    ex.close()  # gone
    f = fetcher(ctx)
    try:
        t0 = time.monotonic()
        got = fetch(f, None, addr, HASHES, timeout_s=10.0)
        assert got.error == "peer unreachable" and time.monotonic() - t0 < 3
        silent = exporter(ctx, Holder(held=3))  # bound, never served
        t0 = time.monotonic()
        got = fetch(f, None, silent.addr, HASHES, timeout_s=0.4)
        assert "timed out" in (got.error or "") and 0.35 < time.monotonic() - t0 < 3
        silent.close()
    finally:
        f.close()
