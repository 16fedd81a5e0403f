"""A prefill worker's prefix blocks shared with its peers: an export socket from which peers fetch
what its prefix cache holds (kvtransfer/prefix_exporter.py), and fetches of its own
(kvtransfer/prefix_fetcher.py) for prompts the gateway says a peer holds more of
(`PrefillRequest.prefix_source`, gateway/prefix_fetch_plan.py).

    PrefillRequest(prefix_source) -> begin: the prompt's hashes past the blocks held here
      -> fetch thread (bounded by the source's timeout) ... the loop goes on with other work
      -> collect (the loop, woken by the fetcher's pipe): blocks loaded as cached blocks
      -> the worker queues the prompt (EngineCore.add_request), which finds them as any cached
         block and computes the rest; a fetch that failed loaded nothing: all of it is computed

A request waits here only for its own fetch, never past the fetch's deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

from pdserve.engine.engine_core import EngineCore
from pdserve.kvtransfer.prefix_exporter import PrefixExporter
from pdserve.kvtransfer.prefix_fetcher import PoolShape, PrefixFetcher
from pdserve.kvtransfer.wire import payload_mac_enabled
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import KvLayout, PrefillRequest

MAX_FETCH_TIMEOUT_S = 30.0  # whatever the gateway asks, a prompt waits no longer for its blocks


@dataclass
class PendingFetch:
    req: PrefillRequest
    hashes: list[bytes]  # the prompt's full blocks a prefill may take from the cache
    first: int  # of them, held here when the fetch began (the fetch asked for the rest)
    started: float  # time.monotonic()


@dataclass(frozen=True)
class FetchOutcome:
    """A request whose fetch ended: it may be queued now."""

    req: PrefillRequest
    blocks: int  # loaded into the pool (0: failed, or nothing left to load)
    nbytes: int  # KV bytes that arrived
    seconds: float


class PrefixSharing:
    def __init__(
        self, engine: EngineCore, ctx: zmq.Context, auth: FrameAuth, bind: str, payload_mac: str, layout: KvLayout
    ) -> None:
        info = engine.info
        self.engine = engine
        tag = payload_mac_enabled(payload_mac, bind, encryption=auth.encryption)
        args = (ctx, auth, bind, info.model_fingerprint, layout, engine.export_prefix)
        self.exporter = PrefixExporter(*args, payload_mac=tag)
        pools = [PoolShape.of(engine.kv_cache)]
        if engine.draft_kv_cache is not None:
            pools.append(PoolShape.of(engine.draft_kv_cache))
        self.fetcher = PrefixFetcher(ctx, auth, info.model_fingerprint, layout, pools, payload_mac=payload_mac)
        self.pending: dict[str, PendingFetch] = {}

    @property
    def addr(self) -> str:
        """The export address peers fetch from (registered: WorkerInfo.export_addr)."""
        return self.exporter.addr

    @property
    def wake(self) -> list[zmq.Socket | int]:
        """What the loop's poll waits on besides its inbox: peers' requests, fetches ended."""
        return [self.exporter.socket, self.fetcher.wake_fd]

    def serve(self) -> None:
        """Answer peers' fetches waiting now (the loop thread: the engine copies the blocks)."""
        self.exporter.serve()

    def begin(self, req: PrefillRequest) -> bool:
        """Start fetching the prompt's blocks its source holds past those held here; False when
        there is nothing to fetch (the request is queued at once)."""
        src = req.prefix_source
        if src is None or req.sampling.prompt_logprobs is not None or src.timeout_s <= 0:
            return False  # (a prompt scored whole takes nothing from the cache)
        hashes = self.engine.prefix_hashes(req.prompt_token_ids)
        want = min(src.num_blocks, len(hashes))
        held = len(self.engine.cached_prefix(hashes[:want]))
        if held >= want:
            return False
        timeout = min(src.timeout_s, MAX_FETCH_TIMEOUT_S)
        self.fetcher.start(req.request_id, src.export_addr, hashes[held:want], timeout)
        self.pending[req.request_id] = PendingFetch(req, hashes, held, time.monotonic())
        return True

    def forget(self, request_id: str) -> None:
        """The request ended while its fetch ran: what arrives for it is dropped."""
        self.pending.pop(request_id, None)

    def collect(self) -> list[FetchOutcome]:
        """Requests whose fetch ended, their blocks loaded into the pool."""
        out = []
        stats = self.fetcher.stats
        for got in self.fetcher.collect():
            p = self.pending.pop(got.fetch_id, None)
            if got.error is not None:
                stats.failures += 1
            if p is None:
                continue
            blocks = self.engine.import_prefix(p.hashes, p.first, got.layers) if got.error is None else 0
            stats.blocks += blocks
            stats.bytes += got.nbytes
            out.append(FetchOutcome(p.req, blocks, got.nbytes, time.monotonic() - p.started))
        return out

    def stats(self) -> dict[str, int]:
        """WorkerStats' prefix_fetch_* and prefix_export_* fields."""
        f, e = self.fetcher.stats, self.exporter.stats
        return {
            "prefix_fetches": f.fetches,
            "prefix_fetch_blocks": f.blocks,
            "prefix_fetch_bytes": f.bytes,
            "prefix_fetch_failures": f.failures,
            "prefix_exports": e.exports,
            "prefix_export_blocks": e.blocks,
            "prefix_export_bytes": e.bytes,
        }

    def close(self) -> None:
        self.exporter.close()
        self.fetcher.close()
