"""The gateway's real backend: routes requests to prefill/decode pools (or a colocated worker)
over authenticated ZMQ, and turns their TokenOutput messages into one ordered stream.

Disaggregated request: wait in the admission queue until a decode worker D grants a lease
(ReserveRequest -> D) ; PrefillRequest(lease) -> P ; first token <- P ; later tokens <- D.
Leaving the stream early (client gone, stop string) sends Abort to both, so every block on both
sides comes back. While P holds the request, D's `LeaseRenewed` answers to P's renewals pass
through here to P. A colocated request waits in the colocated queue for a free seat, then goes
to C.

Requests are handed to prefill workers as soon as they hold a lease, not held back here: a
gateway-side window of 4 steps of a prefill worker's budget cut a 1P1D burst on the bench model
to 156-421 output tok/s against 480-622 without it (two variants, A/B in the same runs).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Literal

import zmq
import zmq.asyncio
from msgspec.structs import replace
from prometheus_client import Histogram

from pdserve import tracing
from pdserve.gateway.admission import AdmissionQueue, QueueLimits, request_priority
from pdserve.gateway.backend import Backend, BackendUnavailable, RequestTooLarge
from pdserve.gateway.kv_index import KvIndex
from pdserve.gateway.membership import WorkerEntry, WorkerTable
from pdserve.gateway.queue_stats import QueueStats
from pdserve.gateway.router import DEFAULT_LOCAL_PREFILL_MAX_TOKENS, Router, RouterPolicy
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.block_hashes import BlockHasher, short_id
from pdserve.protocol.channel import AsyncInbox, AsyncOutbox
from pdserve.protocol.join import JoinAnswer, check_join, worker_plane_addr
from pdserve.protocol.messages import (
    Abort,
    Deregister,
    GenerateRequest,
    Heartbeat,
    KvDestination,
    LeaseRenewed,
    PrefillRequest,
    Register,
    ReserveReply,
    ReserveRequest,
    TokenOutput,
    TokenOutputBatch,
    Welcome,
    WorkerInfo,
    WorkerStats,
    decode_to_gateway,
)
from pdserve.protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


class WorkerLost(Exception):
    def __init__(self, worker_ids: list[str]) -> None:
        super().__init__(", ".join(worker_ids))
        self.worker_ids = worker_ids


_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)


@dataclass
class _AtPrefill:
    """A request handed to a prefill worker that has not sent its first token yet."""

    prefill_id: str
    decode_id: str
    deadline: float  # of its lease, as last renewed
    num_tokens: int


class ClusterBackend(Backend):
    def __init__(
        self,
        auth: FrameAuth,
        inbox_bind: str,
        *,
        kv_transport: str = "auto",
        dead_after_s: float = 2.0,
        stuck_after_s: float = 30.0,
        reserve_timeout_s: float = 5.0,
        on_decode_failure: str = "migrate",
        max_attempts: int = 3,
        queue_limits: QueueLimits = QueueLimits(),
        local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
        router: RouterPolicy = "kv-aware",  # gateway/router.py
        worker_advertise: str | None = None,
        allow_wildcard_bind: bool = False,
    ) -> None:
        if kv_transport not in ("auto", "shm", "zmq"):
            raise ValueError("kv_transport must be auto, shm or zmq")
        if on_decode_failure not in ("migrate", "fail"):
            raise ValueError("on_decode_failure must be migrate or fail")
        self.on_decode_failure = on_decode_failure
        self.max_attempts = max_attempts
        # a decode worker holding all but this many prompt tokens prefills them itself (0: never)
        self.router = Router(router, local_prefill_max_tokens)
        self.auth = auth
        self.inbox_bind = inbox_bind
        self.worker_advertise = worker_advertise  # the worker-plane address /cluster/join hands out
        self.allow_wildcard_bind = allow_wildcard_bind
        self.gateway_id = f"gw-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.kv_transport = kv_transport
        self.reserve_timeout_s = reserve_timeout_s
        self.table = WorkerTable(dead_after_s=dead_after_s, stuck_after_s=stuck_after_s)
        self.kv_index = KvIndex()  # what each worker's prefix cache holds, from its heartbeats
        self._outboxes: dict[str, AsyncOutbox] = {}
        self._reserve_waiters: dict[str, asyncio.Future[ReserveReply]] = {}
        self._streams: dict[str, asyncio.Queue[TokenOutput]] = {}
        self._at_prefill: dict[str, _AtPrefill] = {}
        self._decoding_at: dict[str, str] = {}  # request id -> the decode or colocated worker generating it
        self.queue_wait = Histogram(
            "pdserve_queue_wait_seconds",
            "Time a request waited in a pool's queue",
            ["pool"],
            buckets=_WAIT_BUCKETS,
            registry=None,
        )
        self._queues: dict[str, AdmissionQueue[Any]] = {
            "disaggregated": AdmissionQueue("disaggregated", queue_limits, self._free_decode_seats, self._observe_wait),
            "colocated": AdmissionQueue("colocated", queue_limits, self._free_colocated_seats, self._observe_wait),
        }
        # leases handed to a prefill worker that was lost before it resolved them (no first token):
        # prefill worker id -> {request id: (decode worker id, lease deadline)}
        self._orphaned_leases: dict[str, dict[str, tuple[str, float]]] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._inbox: AsyncInbox | None = None
        self._task: asyncio.Task | None = None
        self._ticker: asyncio.Task | None = None

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._inbox = AsyncInbox(
            self._ctx, self.auth, self.inbox_bind, allow_wildcard=self.allow_wildcard_bind, decoder=decode_to_gateway
        )
        self._task = asyncio.create_task(self._receive_loop())
        self._ticker = asyncio.create_task(self._retry_queues())
        log.info("gateway %s listening for workers on %s", self.gateway_id, self._inbox.addr)

    async def stop(self) -> None:
        for task in (self._task, self._ticker):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for box in self._outboxes.values():
            box.close()
        if self._inbox is not None:
            self._inbox.close()
        if self._ctx is not None:
            self._ctx.term()

    @property
    def inbox_addr(self) -> str:
        assert self._inbox is not None
        return self._inbox.addr

    async def _retry_queues(self) -> None:
        """A waiting request gets a turn at least once a second even when no event says capacity
        changed (a pool that lost every worker: its waiters learn it and get a 503)."""
        while True:
            await asyncio.sleep(1.0)
            self._notify_queues()

    async def _receive_loop(self) -> None:
        assert self._inbox is not None
        while True:
            msg = await self._inbox.recv_one()
            if msg is None:
                continue
            try:
                self._dispatch(msg)
            except Exception:  # one bad message must not stop the gateway
                log.exception("error handling %s", type(msg).__name__)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, TokenOutput):
            self._deliver(msg)
        elif isinstance(msg, TokenOutputBatch):
            for out in msg.outputs:
                self._deliver(out)
        elif isinstance(msg, LeaseRenewed):  # D -> P: the prefill worker holding it may write longer
            at = self._at_prefill.get(msg.request_id)
            if at is not None and at.decode_id == msg.worker_id:
                at.deadline = max(at.deadline, msg.deadline)
                self._send(at.prefill_id, msg)
        elif isinstance(msg, ReserveReply):
            fut = self._reserve_waiters.pop(msg.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg)
            elif msg.lease is not None or msg.local:  # nobody waits for it any more: hand it back
                self._send(msg.worker_id, Abort(request_id=msg.request_id, reason="lease not used", lease_unused=True))
        elif isinstance(msg, Deregister):
            self._deregister(msg)
        elif isinstance(msg, (Register, Heartbeat)):
            info = msg.info
            if info is None:
                return
            stats = msg.stats if isinstance(msg, Heartbeat) else None
            new = self.table.upsert(info, stats)
            if new is None:  # deregistered: a heartbeat sent just before, arriving late
                return
            if isinstance(msg, Heartbeat) and msg.kv is not None:
                self.kv_index.apply(info.worker_id, msg.kv)
            joined = new or info.worker_id not in self._outboxes
            if joined:
                assert self._ctx is not None
                self._forget_replaced(info)
                self._outboxes[info.worker_id] = AsyncOutbox(self._ctx, self.auth, info.control_addr)
                log.info("worker %s (%s) joined at %s", info.worker_id, info.role, info.control_addr)
            # Welcome goes out before any request can be routed to a new worker (same socket, so in
            # order): a worker first heard by heartbeat (its heartbeat thread does not wait for a
            # Welcome) would otherwise take requests with no route back for their outputs.
            if joined or isinstance(msg, Register):
                self._send(info.worker_id, Welcome(gateway_id=self.gateway_id, inbox_addr=msg.via or self.inbox_addr))
            self._notify_queues()  # a worker joined or reported its load: capacity may have changed

    def _deliver(self, out: TokenOutput) -> None:
        queue = self._streams.get(out.request_id)
        if queue is not None:
            queue.put_nowait(out)

    def _deregister(self, msg: Deregister) -> None:
        """A worker leaves: route nothing more to it; requests it still held (a drain that timed
        out) see it gone at their next check and move on as after a death (`_ordered`)."""
        entry = self.table.remove(msg.worker_id)
        if entry is None:
            return
        self.kv_index.forget(msg.worker_id)
        box = self._outboxes.pop(msg.worker_id, None)
        if box is not None:
            box.close()
        log.info("worker %s (%s) left: %s", msg.worker_id, entry.info.role, msg.reason or "deregistered")
        self._release_orphans(msg.worker_id)
        self._notify_queues()

    def _forget_replaced(self, info) -> None:
        """A worker restarted on the same control address replaces the old entry: stop routing
        to the dead id (its outbox would now reach the new process). A replaced prefill worker
        will never write the leases it was lost with: hand them back to their decode workers."""
        for old_id, entry in list(self.table.workers.items()):
            if old_id != info.worker_id and entry.info.control_addr == info.control_addr:
                del self.table.workers[old_id]
                self.kv_index.forget(old_id)
                box = self._outboxes.pop(old_id, None)
                if box is not None:
                    box.close()
                log.info("worker %s replaced by %s at %s", old_id, info.worker_id, info.control_addr)
                self._release_orphans(old_id)

    def _orphan_leases(self, prefill_id: str, request_id: str, decode_id: str, deadline: float) -> None:
        """Remember a lease handed to a prefill worker we lost before its first token. If that
        worker comes back it releases the lease itself (it gets our Abort); if it is replaced (it
        died), `_release_orphans` tells the decode worker nobody will write it."""
        now = time.time()
        for pid in list(self._orphaned_leases):  # forget what the lease deadline has settled
            live = {r: v for r, v in self._orphaned_leases[pid].items() if v[1] > now}
            if live:
                self._orphaned_leases[pid] = live
            else:
                del self._orphaned_leases[pid]
        self._orphaned_leases.setdefault(prefill_id, {})[request_id] = (decode_id, deadline)
        if prefill_id not in self.table.workers:  # already replaced while we waited
            self._release_orphans(prefill_id)

    def _release_orphans(self, prefill_id: str) -> None:
        for request_id, (decode_id, _) in self._orphaned_leases.pop(prefill_id, {}).items():
            log.info("lease of %s on %s: prefill worker %s is gone, handing it back", request_id, decode_id, prefill_id)
            self._send(decode_id, Abort(request_id=request_id, reason="prefill worker gone", lease_unused=True))

    # --- admission --------------------------------------------------------------------------
    def _notify_queues(self) -> None:
        for queue in self._queues.values():
            queue.notify()

    def _free_decode_seats(self) -> int:
        """This gateway's estimate of how many more requests the decode pool can take now."""
        return sum(max(0, d.info.max_num_seqs - d.inflight - d.reserving) for d in self.table.live("decode"))

    async def _start_pair(
        self, request_id: str, prompt: list[int], sampling: SamplingParams
    ) -> tuple[WorkerEntry | None, WorkerEntry, ReserveReply] | None:
        """One admission turn: a decode worker's lease and a prefill worker for it (None when
        the decode worker took the whole request: `ReserveReply.local`); None when no decode
        worker has room now."""
        if not self.table.live("prefill"):
            raise BackendUnavailable("no live prefill worker", retry_after_s=2.0)
        memo: dict[tuple[str, int], list[bytes]] = {}  # the prompt's block hashes per model and block size
        got = await self._reserve(request_id, prompt, sampling, memo)
        if got is None:
            return None
        d, reply = got
        if reply.local:  # the decode worker prefills the short rest itself
            return None, d, reply
        assert reply.lease is not None  # _reserve returns granted leases or local takes only
        # KV is only exchanged between workers running the same model, dtype and shapes.
        prefills = [p for p in self.table.live("prefill") if p.info.model_fingerprint == d.info.model_fingerprint]
        if not prefills:
            self._send(d.worker_id, Abort(request_id=request_id, reason="no prefill worker", lease_unused=True))
            raise BackendUnavailable(f"no live prefill worker for {d.info.model_fingerprint}", retry_after_s=2.0)
        queued: dict[str, int] = {}  # prompt tokens at each prefill worker without a first token yet
        for a in self._at_prefill.values():
            queued[a.prefill_id] = queued.get(a.prefill_id, 0) + a.num_tokens
        held = {w.worker_id: self._held_blocks(w, prompt, memo) * w.info.kv_layout.block_size for w in prefills}
        p = self.router.pick_prefill("prefill", prefills, held, queued, len(prompt))
        self._at_prefill[request_id] = _AtPrefill(p.worker_id, d.worker_id, reply.lease.deadline, len(prompt))
        return p, d, reply

    def _free_colocated_seats(self) -> int:
        return sum(max(0, c.info.max_num_seqs - c.inflight) for c in self.table.live("colocated"))

    def _observe_wait(self, pool: str, seconds: float) -> None:
        self.queue_wait.labels(pool=pool).observe(seconds)

    def queue_stats(self) -> dict[str, QueueStats]:
        stats = {pool: q.stats() for pool, q in self._queues.items()}
        stats["prefill"] = QueueStats(len(self._at_prefill), sum(a.num_tokens for a in self._at_prefill.values()))
        # (handed to prefill workers, no first token yet: queued there or computing)
        return stats

    def collectors(self) -> list:
        return [self.queue_wait]

    def _send(self, worker_id: str, msg) -> bool:
        box = self._outboxes.get(worker_id)
        return box is not None and box.send(msg)

    # --- Backend API ------------------------------------------------------------------------
    def health(self) -> tuple[bool, dict]:
        live = {role: len(self.table.live(role)) for role in ("prefill", "decode", "colocated")}
        ok = (live["prefill"] > 0 and live["decode"] > 0) or live["colocated"] > 0
        return ok, {"live_workers": live}

    def worker_stats(self) -> dict[str, WorkerStats]:
        stats = {wid: w.stats for wid, w in self.table.workers.items() if self.table.is_live(w)}
        if self._inbox is not None:  # the gateway's own inbox
            stats[self.gateway_id] = WorkerStats(dropped_frames=sum(self._inbox.dropped.values()))
        return stats

    def workers(self) -> list[dict]:
        now = time.monotonic()
        out = []
        for w in self.table.workers.values():
            st = w.stats
            alive = self.table.is_live(w, now)
            out.append(
                {
                    "id": w.worker_id,
                    "role": w.info.role,
                    "state": ("draining" if w.draining else "ready") if alive else "unresponsive",
                    "control_addr": w.info.control_addr,
                    "kv_addr": w.info.kv_addr,
                    "host": w.info.host,
                    "pid": w.info.pid,
                    "last_heard_s": round(now - w.last_seen, 3),
                    "load": {
                        "routed_requests": w.inflight,
                        "running": st.num_running,
                        "waiting": st.num_waiting,
                        "max_num_seqs": w.info.max_num_seqs,
                        "leases_active": st.leases_active,
                        "steps": st.steps,
                    },
                    "kv": {
                        "blocks_total": st.kv_blocks_total,
                        "blocks_used": st.kv_blocks_total - st.kv_blocks_free,
                        "blocks_cached": st.kv_blocks_cached,
                        "usage": round(1 - st.kv_blocks_free / st.kv_blocks_total, 4) if st.kv_blocks_total else 0.0,
                    },
                }
            )
        return sorted(out, key=lambda w: (w["role"], w["id"]))

    def join(self, body: bytes, url_host: str) -> JoinAnswer:
        claim = check_join(self.auth, body)
        addr = worker_plane_addr(self.inbox_addr, self.worker_advertise, url_host)
        log.info("a %s worker on %s asked to join: sent to %s", claim.role, claim.host, addr)
        return JoinAnswer(gateway_id=self.gateway_id, worker_addr=addr)

    def routed_requests(self) -> dict[str, int]:
        return {wid: w.inflight for wid, w in self.table.workers.items() if self.table.is_live(w)}

    def stop_choice(self, request_id: str, index: int) -> None:
        # (a group that migrates later reruns every member; the gateway drops this one's tokens)
        worker_id = self._decoding_at.get(request_id)
        if worker_id is not None:
            self._send(worker_id, Abort(request_id=request_id, reason="stop string", seq_index=index))

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> AsyncGenerator[TokenOutput, None]:
        if sampling.is_group:
            self._check_group_fits(len(prompt_token_ids), sampling)
        if self.table.live("prefill") and self.table.live("decode"):
            stream = self._generate_disaggregated(request_id, prompt_token_ids, sampling)
        elif self.table.live("colocated"):
            stream = self._generate_colocated(request_id, prompt_token_ids, sampling)
        else:
            raise BackendUnavailable(
                "no live workers: need a prefill and a decode worker, or a colocated worker", retry_after_s=2.0
            )
        async for out in stream:
            yield out

    def _check_group_fits(self, prompt_len: int, sampling: SamplingParams) -> None:
        """A group whose sequences at full length (sharing only the prompt's full blocks) need
        more KV blocks than any live decode (or colocated) worker has is refused now, with 400,
        not after its prefill (the engine checks the same, SamplingParams.worst_case_blocks)."""
        pool = self.table.live("decode") or self.table.live("colocated")
        if not pool:
            return  # (no worker: generate() answers 503)
        fits = [
            (sampling.worst_case_blocks(prompt_len, w.info.kv_layout.block_size), w.info.kv_layout.num_blocks)
            for w in pool
        ]
        if all(worst > blocks for worst, blocks in fits):
            worst = min(w for w, _ in fits)
            raise RequestTooLarge(
                f"{sampling.num_seqs} sequences of up to {sampling.max_tokens} tokens after a {prompt_len}-token "
                f"prompt need up to {worst} KV blocks; the largest worker pool has {max(b for _, b in fits)}: "
                "lower n, best_of or max_tokens"
            )

    def _block_hashes(
        self, prompt: list[int], info: WorkerInfo, memo: dict[tuple[str, int], list[bytes]]
    ) -> list[bytes]:
        key = (info.model_fingerprint, info.kv_layout.block_size)
        if key not in memo:
            memo[key] = BlockHasher(*key).hashes(prompt)
        return memo[key]

    def _held_blocks(self, w: WorkerEntry, prompt: list[int], memo: dict[tuple[str, int], list[bytes]]) -> int:
        """How many of the prompt's leading blocks `w` holds, as its heartbeats tell (a hint)."""
        ids = [short_id(h) for h in self._block_hashes(prompt, w.info, memo)]
        return self.kv_index.leading_blocks(w.worker_id, ids)

    async def _reserve(
        self,
        request_id: str,
        prompt: list[int],
        sampling: SamplingParams,
        memo: dict[tuple[str, int], list[bytes]],
    ) -> tuple[WorkerEntry, ReserveReply] | None:
        """A lease from the first live decode worker that grants one; None when every one is full
        now (the request waits in the queue), BackendUnavailable when none could ever take it."""
        decodes = self.table.live("decode")
        if not decodes:
            raise BackendUnavailable("no live decode worker", retry_after_s=2.0)
        reasons, full = [], False
        held = {d.worker_id: self._held_blocks(d, prompt, memo) for d in decodes}
        for d in self.router.decode_order(decodes, held, len(prompt)):
            # ask it to prefill the rest itself when its heartbeats say it holds all but a little
            local = self.router.local_prefill_tokens(held[d.worker_id] * d.info.kv_layout.block_size, len(prompt))
            fut = asyncio.get_running_loop().create_future()
            self._reserve_waiters[request_id] = fut
            d.reserving += 1
            self._send(
                d.worker_id,
                ReserveRequest(
                    request_id=request_id,
                    gateway_id=self.gateway_id,
                    to_worker=d.worker_id,
                    num_prompt_tokens=len(prompt),
                    max_tokens=sampling.max_tokens,
                    block_hashes=self._block_hashes(prompt, d.info, memo),
                    local_prefill_max_tokens=local,
                    prompt_token_ids=prompt if local else [],
                    sampling=sampling if local else None,
                    num_seqs=sampling.num_seqs,
                    traceparent=tracing.current_traceparent.get(),
                ),
            )
            try:
                reply = await asyncio.wait_for(fut, self.reserve_timeout_s)
            except asyncio.TimeoutError:  # busy or dying: try the others, then wait in the queue
                full = True
                self._send(d.worker_id, Abort(request_id=request_id, reason="reservation timed out", lease_unused=True))
                continue
            finally:
                d.reserving -= 1
                self._reserve_waiters.pop(request_id, None)
            if reply.lease is not None or reply.local:
                return d, reply
            full = full or reply.capacity
            reasons.append(f"{d.worker_id}: {reply.reason}")
        if full:
            return None
        raise BackendUnavailable(
            "no decode worker can take the request (" + "; ".join(reasons) + ")", retry_after_s=1.0
        )

    def _transport_for(self, p: WorkerEntry, d: WorkerEntry) -> Literal["zmq", "shm"]:
        can_shm = d.info.shm_name is not None and p.info.host == d.info.host
        if self.kv_transport == "shm" and not can_shm:
            log.warning("shm transport asked for but %s and %s do not share a host", p.worker_id, d.worker_id)
        return "shm" if can_shm and self.kv_transport in ("auto", "shm") else "zmq"

    async def _generate_disaggregated(self, request_id, prompt, sampling):
        """Reserve on D, prefill on P, stream. If a worker dies mid-request: a prefill worker
        before the first token -> retried on another pair; a decode worker -> with
        `on_decode_failure="migrate"` the prompt plus the tokens already streamed are prefilled
        again on a live pair and the stream goes on (no duplicate or missing tokens); with
        "fail" the stream ends with an error.

        A group (n > 1, best_of, beams) migrates by running again from its prompt: its members'
        seeds (or the beam search) replay the same tokens, and each choice's tokens already
        streamed are skipped."""
        generated: list[int] = []
        delivered: dict[int, int] = {}  # a group's tokens streamed per choice
        attempt = 0
        while True:
            attempt += 1
            sub_id = request_id if attempt == 1 else f"{request_id}.m{attempt}"
            if sampling.is_group:
                pair = self._one_pair(sub_id, prompt, sampling, resumed=attempt > 1)
            else:
                remaining = replace(
                    sampling,
                    max_tokens=sampling.max_tokens - len(generated),
                    min_tokens=max(0, sampling.min_tokens - len(generated)),
                    # the constraint's matcher replays what was generated (the new prompt's tail)
                    structured=None
                    if sampling.structured is None
                    else replace(sampling.structured, resumed_tokens=len(generated)),
                )
                pair = self._one_pair(sub_id, prompt + generated, remaining, resumed=bool(generated))
            try:
                async for out in pair:
                    if sampling.is_group:
                        out = _skip_delivered(replace(out, request_id=request_id), delivered)
                        if out is None:
                            continue
                    elif out.token_ids or out.index:
                        out = replace(out, request_id=request_id, index=out.index + len(generated))
                    else:
                        out = replace(out, request_id=request_id)
                    generated.extend(out.token_ids)
                    yield out
                return
            except WorkerLost as lost:
                retry = attempt < self.max_attempts and (not generated or self.on_decode_failure == "migrate")
                log.warning(
                    "request %s lost worker(s) %s after %d tokens; %s",
                    request_id,
                    lost.worker_ids,
                    len(generated),
                    "retrying on a live pair" if retry else "failing it",
                )
                if not retry:
                    yield TokenOutput(
                        request_id=request_id,
                        index=0 if sampling.is_group else len(generated),
                        finish_reason="error",
                        error=f"worker {', '.join(lost.worker_ids)} stopped responding",
                    )
                    return
                if not self.table.live("prefill") or not self.table.live("decode"):
                    await asyncio.sleep(min(2.0, self.table.dead_after_s))  # a restart may be on its way
                    if not self.table.live("prefill") or not self.table.live("decode"):
                        yield TokenOutput(
                            request_id=request_id,
                            index=0 if sampling.is_group else len(generated),
                            finish_reason="error",
                            error="no live prefill/decode pair to continue the request",
                        )
                        return

    async def _one_pair(self, request_id, prompt, sampling, resumed: bool = False):
        queued_at = time.monotonic()
        p, d, reply = await self._queues["disaggregated"].admit(
            len(prompt),
            lambda: self._start_pair(request_id, prompt, sampling),
            resumed=resumed,
            priority=request_priority.get(),
        )
        tracing.record_span(
            "gateway.queue",
            tracing.current_traceparent.get(),
            queued_at,
            attributes={
                "pdserve.decode_worker": d.worker_id,
                "pdserve.prefill_worker": p.worker_id if p else "",
                "pdserve.resumed": resumed,
            },
        )
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        self._decoding_at[request_id] = d.worker_id
        d.inflight += 1
        if p is not None:
            p.inflight += 1
        finished = False
        got_first = False
        choices = sampling.n if sampling.is_group else 1
        try:
            if p is not None:  # else the decode worker prefills the short rest itself
                assert reply.lease is not None
                dest = KvDestination(
                    worker_id=d.worker_id,
                    kv_addr=d.info.kv_addr or "",
                    shm_name=d.info.shm_name,
                    transport=self._transport_for(p, d),
                    lease=reply.lease,
                    layout=d.info.kv_layout,
                )
                self._send(
                    p.worker_id,
                    PrefillRequest(
                        request_id=request_id,
                        gateway_id=self.gateway_id,
                        prompt_token_ids=prompt,
                        sampling=sampling,
                        dest=dest,
                        arrival_time=time.time(),
                        traceparent=tracing.current_traceparent.get(),
                    ),
                )
            watched = lambda: (d,) if got_first or p is None else (p, d)  # noqa: E731
            async for out, last in self._ordered(request_id, queue, watched, choices):
                if not got_first:  # the prefill worker is done with it
                    got_first = True
                    self._at_prefill.pop(request_id, None)
                    if "prefill_queue_s" in out.timings:
                        self._observe_wait("prefill", out.timings["prefill_queue_s"])
                if last:
                    # Ended by a worker: it has released its side. Ended here (abort): `finished`
                    # stays False and the finally block aborts both workers.
                    finished = bool(out.worker_id)
                    if p is not None and out.worker_id == p.worker_id:  # ended at its first token: free D's lease
                        self._send(d.worker_id, Abort(request_id=request_id, reason="finished at prefill"))
                yield out
        except WorkerLost as lost:
            at = self._at_prefill.get(request_id)
            if at is not None and p is not None and p.worker_id in lost.worker_ids:
                self._orphan_leases(p.worker_id, request_id, d.worker_id, at.deadline)
            raise
        finally:
            d.inflight -= 1
            if p is not None:
                p.inflight -= 1
            self._at_prefill.pop(request_id, None)
            self._streams.pop(request_id, None)
            self._decoding_at.pop(request_id, None)
            if not finished:
                if p is not None:
                    self._send(p.worker_id, Abort(request_id=request_id, reason="stream closed"))
                self._send(d.worker_id, Abort(request_id=request_id, reason="stream closed"))
            self._notify_queues()  # a decode seat is free

    async def _seat_colocated(self, prompt: list[int]) -> WorkerEntry | None:
        """The colocated worker with a free seat and the least expected work before this prompt's
        first token (or as the router's policy says: gateway/router.py), taken at once; or None."""
        live = self.table.live("colocated")
        if not live:
            raise BackendUnavailable("no live colocated worker", retry_after_s=2.0)
        free = [c for c in live if c.info.max_num_seqs <= 0 or c.inflight < c.info.max_num_seqs]
        if not free:
            return None
        memo: dict[tuple[str, int], list[bytes]] = {}
        held = {w.worker_id: self._held_blocks(w, prompt, memo) * w.info.kv_layout.block_size for w in free}
        c = self.router.pick_prefill("colocated", free, held, {}, len(prompt))
        c.inflight += 1
        return c

    async def _generate_colocated(self, request_id, prompt, sampling):
        queued_at = time.monotonic()
        c = await self._queues["colocated"].admit(
            len(prompt), lambda: self._seat_colocated(prompt), priority=request_priority.get()
        )
        tracing.record_span(
            "gateway.queue",
            tracing.current_traceparent.get(),
            queued_at,
            attributes={"pdserve.colocated_worker": c.worker_id},
        )
        queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
        self._streams[request_id] = queue
        self._decoding_at[request_id] = c.worker_id
        finished = False
        try:
            self._send(
                c.worker_id,
                GenerateRequest(
                    request_id=request_id,
                    gateway_id=self.gateway_id,
                    prompt_token_ids=prompt,
                    sampling=sampling,
                    arrival_time=time.time(),
                    traceparent=tracing.current_traceparent.get(),
                ),
            )
            try:
                async for out, last in self._ordered(
                    request_id, queue, lambda: (c,), sampling.n if sampling.is_group else 1
                ):
                    finished = last and bool(out.worker_id)
                    yield out
            except WorkerLost as lost:
                yield TokenOutput(
                    request_id=request_id,
                    finish_reason="error",
                    error=f"worker {', '.join(lost.worker_ids)} stopped responding",
                )
        finally:
            c.inflight -= 1
            self._streams.pop(request_id, None)
            self._decoding_at.pop(request_id, None)
            if not finished:
                self._send(c.worker_id, Abort(request_id=request_id, reason="client gone"))
            self._notify_queues()  # a colocated seat is free

    async def _ordered(
        self,
        request_id: str,
        queue: asyncio.Queue[TokenOutput],
        watched: Callable[[], tuple[WorkerEntry, ...]],
        choices: int = 1,
    ) -> AsyncIterator[tuple[TokenOutput, bool]]:
        """Yield (output, whether it is the request's last) in token order per choice (P and D
        send on different sockets) until each of the `choices` has finished; raise WorkerLost
        when a worker the request still depends on (`watched()`) stops heartbeating."""
        next_index = [0] * choices
        held: list[dict[int, TokenOutput]] = [{} for _ in range(choices)]
        ended: set[int] = set()
        while True:
            try:
                out = await asyncio.wait_for(queue.get(), timeout=0.25)
            except asyncio.TimeoutError:
                dead = [w.worker_id for w in watched() if not self.table.is_live(w)]
                if dead:
                    raise WorkerLost(dead) from None
                continue
            if out.error is not None or out.finish_reason == "abort":
                yield out, True
                return
            i = out.seq_index
            if not 0 <= i < choices:
                log.warning("request %s: output for choice %d of %d dropped", request_id, i, choices)
                continue
            held[i][out.index] = out
            while next_index[i] in held[i]:
                out = held[i].pop(next_index[i])
                next_index[i] += max(1, len(out.token_ids))
                if out.finish_reason is not None:
                    ended.add(i)
                yield out, len(ended) == choices
                if len(ended) == choices:
                    return


def _skip_delivered(out: TokenOutput, delivered: dict[int, int]) -> TokenOutput | None:
    """A migrated group's output less what its choice already streamed (None: all of it was)."""
    done = delivered.get(out.seq_index, 0)
    skip = max(0, done - out.index)
    if out.token_ids and skip >= len(out.token_ids) and out.finish_reason is None:
        return None
    if skip:
        out = replace(
            out,
            index=out.index + skip,
            token_ids=out.token_ids[skip:],
            logprobs=out.logprobs[skip:] if out.logprobs is not None else None,
        )
    delivered[out.seq_index] = max(done, out.index + len(out.token_ids))
    return out
