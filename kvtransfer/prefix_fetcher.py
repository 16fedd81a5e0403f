"""The asking side of a prefix fetch (the peer's side: kvtransfer/prefix_exporter.py): a prompt's
leading blocks that a peer worker holds come over the KV plane instead of being computed.

Each fetch runs in a thread of its own, off the worker's loop, on a DEALER socket of its own
connected to the peer's export address (which the gateway took from the peer's registration):

    connect (CURVE where the cluster encrypts the address) -> writable within CONNECT_TIMEOUT_S,
    else "peer unreachable" -> PrefixFetch -> frames until PrefixFetchDone or the deadline

Every frame must pass its frame MAC, decode, and match what was asked: this fetch, each layer once
in order (`seq`), the same leading count n of the asked blocks in every layer, this worker's
dtype and block shape per pool (target's layers, then a draft model's), the byte count, and the
payload's HMAC tag when `payload_mac` is on. One frame failing any check fails the whole fetch:
nothing of it is used, never wrong KV. So does a timeout, a peer that sends fewer layers than
it said, or one that holds none. A finished fetch (its payloads, or its error) is handed to the
loop through `collect`, which a pipe wakes (`wake_fd`); the loop then loads the blocks into its
pool (EngineCore.import_prefix) and admits the request, which computes what did not come.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import msgspec
import torch
import zmq

from pdserve.kvtransfer.prefix_wire import decode_reply, encode_prefix
from pdserve.kvtransfer.wire import KvFrameHeader, dtype_name, element_size, payload_mac_enabled
from pdserve.protocol.auth import AuthError, FrameAuth
from pdserve.protocol.messages import KvLayout, PrefixFetch, PrefixFetchDone
from pdserve.protocol.wake_pipe import WakePipe

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 1.0  # a peer not reachable within this (gone, or no export socket) fails the fetch


@dataclass(frozen=True)
class PoolShape:
    """One KV pool's layers as frames carry them: [2, n, block_size, heads, W] of `dtype`."""

    num_layers: int
    block_shape: tuple[int, int, int]  # block_size, heads, W
    dtype: str

    @classmethod
    def of(cls, pool: torch.Tensor) -> "PoolShape":
        """A pool [L, 2, N, bs, H, W]."""
        return cls(pool.shape[0], (pool.shape[3], pool.shape[4], pool.shape[5]), dtype_name(pool.dtype))

    def block_bytes(self) -> int:
        bs, h, w = self.block_shape
        return 2 * bs * h * w * element_size(self.dtype)


@dataclass
class FetchedPrefix:
    """A fetch's outcome: the KV of `hashes` (the first n asked), one payload per layer."""

    fetch_id: str
    hashes: list[bytes]
    layers: list[memoryview]  # [2, n, bs, H, W] bytes per layer: the target's, then a draft's
    nbytes: int
    seconds: float
    error: str | None = None


@dataclass
class FetchStats:
    """Totals since start (WorkerStats' prefix_fetch_* fields)."""

    fetches: int = 0
    blocks: int = 0  # blocks that arrived, verified, and were loaded into the pool
    bytes: int = 0
    failures: int = 0  # fetches that brought nothing


@dataclass
class _Expect:
    fetch_id: str
    asked: int
    pools: list[PoolShape]
    payload_mac: bool
    layers: list[memoryview] = field(default_factory=list)
    n: int | None = None

    def pool_of(self, layer: int) -> PoolShape | None:
        for p in self.pools:
            if layer < p.num_layers:
                return p
            layer -= p.num_layers
        return None

    @property
    def num_layers(self) -> int:
        return sum(p.num_layers for p in self.pools)


class PrefixFetcher:
    def __init__(
        self,
        ctx: zmq.Context,
        auth: FrameAuth,
        model_fingerprint: str,
        layout: KvLayout,
        pools: list[PoolShape],
        *,
        payload_mac: str = "auto",
    ) -> None:
        """`pools`: this worker's KV pools (the target's, then a draft model's) the blocks land in;
        `payload_mac`: when to require each payload's HMAC tag, by the peer's address (the KV
        plane's policy, `--kv-payload-mac`: kvtransfer/wire.py payload_mac_enabled)."""
        payload_mac_enabled(payload_mac)  # a bad mode fails here
        self.ctx, self.auth, self.model_fingerprint, self.layout = ctx, auth, model_fingerprint, layout
        self.pools, self.payload_mac = pools, payload_mac
        self.stats = FetchStats()
        self._done: queue.SimpleQueue[FetchedPrefix] = queue.SimpleQueue()
        self._wake = WakePipe()
        self._threads: set[threading.Thread] = set()
        self._closed = False

    @property
    def wake_fd(self) -> int:
        """Readable once a fetch has ended (collect() empties it)."""
        return self._wake.fd

    def start(self, fetch_id: str, addr: str, hashes: list[bytes], timeout_s: float) -> None:
        """Fetch the leading run of `hashes` the peer at `addr` holds, for at most `timeout_s`."""
        self.stats.fetches += 1
        t = threading.Thread(
            target=self._run, args=(fetch_id, addr, list(hashes), timeout_s), name="prefix-fetch", daemon=True
        )
        self._threads = {x for x in self._threads if x.is_alive()} | {t}
        t.start()

    def collect(self) -> list[FetchedPrefix]:
        """Fetches ended since the last call (successful or not)."""
        self._wake.clear()
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def _run(self, fetch_id: str, addr: str, hashes: list[bytes], timeout_s: float) -> None:
        started = time.monotonic()
        try:
            n, layers, error = self._fetch(fetch_id, addr, hashes, started + timeout_s)
        except zmq.ContextTerminated:  # the worker is stopping
            n, layers, error = 0, [], "the worker is stopping"
        except Exception as e:  # never let a fetch take the worker down: it computes instead
            log.exception("prefix fetch %s from %s failed", fetch_id, addr)
            n, layers, error = 0, [], f"internal error: {e!r}"
        nbytes = sum(p.nbytes for p in layers)
        result = FetchedPrefix(fetch_id, hashes[:n], layers, nbytes, time.monotonic() - started, error)
        if error is not None:
            log.info("prefix fetch %s from %s: %s (the blocks are computed)", fetch_id, addr, error)
        self._done.put(result)
        if self._closed:
            return  # (the pipe is closed, its number maybe another file's now)
        self._wake.wake()

    def _fetch(
        self, fetch_id: str, addr: str, hashes: list[bytes], deadline: float
    ) -> tuple[int, list[memoryview], str | None]:
        """(blocks, their layers' payloads, None) or (0, [], why not)."""
        sock = self.ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)  # writable only once connected: a gone peer shows
            self.auth.secure_connect(sock, addr)
            sock.connect(addr)
            if not sock.poll(int(min(CONNECT_TIMEOUT_S, max(0.0, deadline - time.monotonic())) * 1000), zmq.POLLOUT):
                return 0, [], "peer unreachable"
            mac = payload_mac_enabled(self.payload_mac, addr, encryption=self.auth.encryption)
            ask = PrefixFetch(
                fetch_id=fetch_id,
                block_hashes=hashes,
                model_fingerprint=self.model_fingerprint,
                layout=self.layout,
                payload_mac=mac,
            )
            sock.send_multipart(self.auth.sign(encode_prefix(ask)), flags=zmq.NOBLOCK)
            want = _Expect(fetch_id, len(hashes), self.pools, mac)
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not sock.poll(left_ms, zmq.POLLIN):
                    return 0, [], f"timed out after {len(want.layers)} of {want.num_layers} layers"
                error, done = self._accept(want, sock.recv_multipart(copy=False))
                if error is not None:
                    return 0, [], error
                if done is not None:
                    return self._finish(want, done)
        finally:
            sock.close(linger=0)

    def _accept(self, want: _Expect, frames: list) -> tuple[str | None, PrefixFetchDone | None]:
        """Check one reply message; (error, None), (None, done) or (None, None) for a layer kept."""
        try:
            header, payloads = self.auth.verify(frames)
            msg = decode_reply(header)
        except AuthError as e:
            return f"frame MAC: {e}", None
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            return f"undecodable reply: {e}", None
        fetch_id = msg.request_id if isinstance(msg, KvFrameHeader) else msg.fetch_id
        if fetch_id != want.fetch_id:
            return "a reply to another fetch", None
        if isinstance(msg, PrefixFetchDone):
            return (None, msg) if not payloads else ("a done message with a payload", None)
        return self._check_layer(want, msg, payloads), None

    def _check_layer(self, want: _Expect, h: KvFrameHeader, payloads: list[memoryview]) -> str | None:
        layer = len(want.layers)
        pool = want.pool_of(layer)
        n = len(h.block_ids)
        if pool is None or h.layer != layer or h.seq != layer:
            return f"layer {h.layer} (seq {h.seq}) out of order: expected {layer}"
        if n == 0 or n > want.asked or h.block_ids != list(range(n)) or (want.n is not None and n != want.n):
            return "blocks other than the leading run asked for"
        if h.dtype != pool.dtype or h.shape != [2, n, *pool.block_shape] or h.kv_head_start != 0:
            return f"layout mismatch: {h.dtype} {h.shape}, this worker {pool.dtype} [2, {n}, {list(pool.block_shape)}]"
        if len(payloads) != 1 or payloads[0].nbytes != h.nbytes or h.nbytes != n * pool.block_bytes():
            return "payload size mismatch"
        if want.payload_mac and not self.auth.check_payload_mac(h.payload_mac, payloads[0]):
            return "payload MAC missing or wrong"
        want.n = n
        want.layers.append(payloads[0])
        return None

    @staticmethod
    def _finish(want: _Expect, done: PrefixFetchDone) -> tuple[int, list[memoryview], str | None]:
        if done.num_blocks == 0:
            return 0, [], f"the peer sent none: {done.reason or 'no reason given'}"
        if done.num_blocks != want.n or len(want.layers) != want.num_layers:
            return 0, [], f"incomplete: {len(want.layers)} of {want.num_layers} layers of {done.num_blocks} blocks"
        return done.num_blocks, want.layers, None

    def close(self) -> None:
        """Stop taking results; the pipe is closed once no fetch is left in flight (a fetch still
        running ends by its deadline, or when the worker's ZMQ context ends)."""
        if self._closed:
            return
        self._closed = True
        for t in self._threads:
            t.join(timeout=0.1)
        if not any(t.is_alive() for t in self._threads):
            self._wake.close()
