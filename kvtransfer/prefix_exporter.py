"""A worker's export socket: peers fetch the prompt blocks its prefix cache holds instead of
computing them (the asking side: kvtransfer/prefix_fetcher.py; the wire: kvtransfer/prefix_wire.py).

    peer DEALER --PrefixFetch(hashes)--> ROUTER (this, bound like every internal socket)
                <--KvFrameHeader + payload, one per layer; PrefixFetchDone(n)--

The worker's loop calls `serve` (its poller wakes on `socket`): each request is verified (frame
MAC) and decoded, refused unless the asker's model fingerprint and KV layout are this worker's,
then `read(hashes)` (the engine's `export_prefix`, on the loop thread: it pins the leading run it
holds, copies it out, unpins) gives the KV, sent as it is stored. A payload carries its HMAC tag
when the asker wants it or the policy says so (`--kv-payload-mac`, as the KV plane). A peer that
left, or whose queue is full, gets nothing more (ROUTER_MANDATORY, no blocking): it times out.
Addresses are bound from config (loopback by default; wildcards refused), never taken from a
request. Nothing is pickled.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch
import zmq

from pdserve.kvtransfer.prefix_wire import decode_request, encode_prefix, same_kv_identity
from pdserve.kvtransfer.wire import KvFrameHeader, dtype_name
from pdserve.protocol.auth import AuthError, FrameAuth
from pdserve.protocol.channel import DEFAULT_BIND, bind_socket
from pdserve.protocol.messages import KvLayout, PrefixFetch, PrefixFetchDone

log = logging.getLogger(__name__)

# the blocks' KV of each pool ([L, 2, n, bs, H, W] on the CPU: the target's, then a draft's) for
# the leading run of the hashes this worker holds; [] when it holds none
ReadBlocks = Callable[[list[bytes]], list[torch.Tensor]]


@dataclass
class ExportStats:
    """Totals since start (WorkerStats' prefix_export_* fields)."""

    exports: int = 0  # fetches answered with at least one block
    blocks: int = 0
    bytes: int = 0
    refused: int = 0  # fetches answered with none (other model or layout, nothing held, send failed)


class PrefixExporter:
    def __init__(
        self,
        ctx: zmq.Context,
        auth: FrameAuth,
        bind_addr: str | None,
        model_fingerprint: str,
        layout: KvLayout,
        read: ReadBlocks,
        *,
        payload_mac: bool = False,
        allow_wildcard: bool = False,
    ) -> None:
        """`payload_mac`: tag every payload whether or not the asker wants it (the policy for this
        address, kvtransfer/wire.py payload_mac_enabled)."""
        self.auth, self.model_fingerprint, self.layout, self.read = auth, model_fingerprint, layout, read
        self.payload_mac = payload_mac
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a peer gone raises, not vanishes
            auth.secure_bind(sock, bind_addr or DEFAULT_BIND)
            self.addr = bind_socket(sock, bind_addr, allow_wildcard)
        except BaseException:
            sock.close(linger=0)
            raise
        self.socket = sock
        self.stats = ExportStats()
        self.dropped: collections.Counter[str] = collections.Counter()

    def serve(self, max_requests: int = 8) -> int:
        """Answer the fetches waiting now (at most `max_requests`); returns how many."""
        served = 0
        while served < max_requests and self.socket.poll(0, zmq.POLLIN):
            frames = self.socket.recv_multipart(copy=False)
            req = self._parse(frames)
            if req is None:
                continue
            self._answer(frames[0].bytes, req)
            served += 1
        return served

    def _parse(self, frames: list) -> PrefixFetch | None:
        try:
            header, payloads = self.auth.verify(frames[1:])  # frames[0]: the peer's routing id
        except AuthError as e:
            self._drop("auth", e)
            return None
        if payloads:
            self._drop("unexpected_payload", "a fetch carries no payload")
            return None
        try:
            return decode_request(header)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._drop("decode", e)
            return None

    def _drop(self, reason: str, detail: object) -> None:
        self.dropped[reason] += 1
        n = self.dropped[reason]
        if n & (n - 1) == 0:  # the 1st, 2nd, 4th ... of each reason
            log.warning("prefix export %s: dropped a request (%s, %d so far): %s", self.addr, reason, n, detail)

    def _answer(self, peer: bytes, req: PrefixFetch) -> None:
        if req.model_fingerprint != self.model_fingerprint or not same_kv_identity(req.layout, self.layout):
            self._done(peer, req.fetch_id, 0, "another model or KV layout")
            return
        pools = self.read(list(req.block_hashes)) if req.block_hashes else []
        n = pools[0].shape[2] if pools else 0
        if n == 0:
            self._done(peer, req.fetch_id, 0, "none of the blocks held")
            return
        mac = self.payload_mac or req.payload_mac
        sent, layer = 0, 0
        try:
            for pool in pools:  # [L, 2, n, bs, H, W]
                for kv in pool:  # [2, n, bs, H, W], contiguous
                    sent += self._send_layer(peer, req.fetch_id, layer, kv, mac)
                    layer += 1
        except (zmq.Again, zmq.ZMQError) as e:  # the peer left, or its queue is full: it times out
            self.stats.refused += 1
            log.warning("prefix export to a peer stopped after %d layers: %s", layer, e)
            return
        if self._done(peer, req.fetch_id, n):
            self.stats.exports += 1
            self.stats.blocks += n
            self.stats.bytes += sent

    def _send_layer(self, peer: bytes, fetch_id: str, layer: int, kv: torch.Tensor, mac: bool) -> int:
        payload = kv.reshape(-1).view(torch.uint8).numpy()  # (no copy: ZMQ holds it until sent)
        header = KvFrameHeader(
            request_id=fetch_id,
            lease_epoch=0,
            layer=layer,
            block_ids=list(range(kv.shape[1])),
            kv_head_start=0,
            kv_head_end=kv.shape[3],
            dtype=dtype_name(kv.dtype),
            shape=list(kv.shape),
            nbytes=payload.nbytes,
            seq=layer,
            payload_mac=self.auth.payload_mac(payload) if mac else None,
        )
        frames = self.auth.sign(encode_prefix(header), [payload])
        self.socket.send_multipart([peer, *frames], flags=zmq.NOBLOCK, copy=False)
        return payload.nbytes

    def _done(self, peer: bytes, fetch_id: str, n: int, reason: str = "") -> bool:
        if n == 0:
            self.stats.refused += 1
        done = PrefixFetchDone(fetch_id=fetch_id, num_blocks=n, reason=reason)
        try:
            self.socket.send_multipart([peer, *self.auth.sign(encode_prefix(done))], flags=zmq.NOBLOCK)
            return True
        except (zmq.Again, zmq.ZMQError):
            return False

    def close(self) -> None:
        if not self.socket.closed:
            self.socket.close(linger=0)
