"""The gateway's real backend: requests routed to prefill/decode pools (or colocated workers) over
authenticated ZMQ, each request's outputs put in token order onto its client's stream.

The parts, one concept each:
    gateway/worker_plane.py      sockets: the inbox, one outbox per worker, the receive loop
    gateway/cluster_members.py   membership (Register, Heartbeat, Deregister), orphaned leases,
                                 what workers hold of a prompt, GET /v1/workers
    gateway/request_record.py    a request's one record (state, workers, lease, order, stream)
    gateway/token_order.py       P's first token and D's tokens in order
    gateway/output_stream.py     the one queue from the socket to the HTTP response
    gateway/request_flow.py      disaggregated: admission -> lease -> prefill -> decode -> migration
    gateway/colocated_flow.py    colocated: admission -> one worker
    gateway/router.py, admission.py, membership.py, kv_index.py
This file wires them: `_dispatch` sends each message to its part (a token output straight to its
record), one ticker checks the liveness of every worker a request depends on, and the Backend
API the HTTP layer calls.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from typing import Any

from prometheus_client import Counter, Histogram

from pdserve.gateway.admission import AdmissionQueue, QueueLimits
from pdserve.gateway.backend import Backend, BackendUnavailable, RequestTooLarge
from pdserve.gateway.cluster_members import ClusterMembers
from pdserve.gateway.colocated_flow import ColocatedFlow
from pdserve.gateway.membership import STUCK_AFTER_S, WorkerTable
from pdserve.gateway.output_stream import OutputStream
from pdserve.gateway.prefill_placement import DEFAULT_PREFILL_PLACEMENT, PrefillPlacement
from pdserve.gateway.queue_stats import QueueStats
from pdserve.gateway.reconcile import RequestForgotten, forgotten
from pdserve.gateway.request_flow import (
    DEFAULT_KV_TRANSPORT,
    DEFAULT_ON_DECODE_FAILURE,
    KV_TRANSPORTS,
    DisaggregatedFlow,
)
from pdserve.gateway.request_record import RequestRecord, RequestTable, WorkerLost
from pdserve.gateway.router import DEFAULT_LOCAL_PREFILL_MAX_TOKENS, DEFAULT_ROUTER, Router, RouterPolicy
from pdserve.gateway.worker_plane import WorkerPlane
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.join import JoinAnswer, check_join, worker_plane_addr
from pdserve.protocol.messages import (
    Abort,
    Deregister,
    Heartbeat,
    LeaseRenewed,
    Message,
    Register,
    ReserveReply,
    TokenOutput,
    TokenOutputBatch,
    WorkerStats,
)
from pdserve.protocol.sampling import SamplingParams

log = logging.getLogger(__name__)

_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)
LIVENESS_CHECK_S = 0.25  # how often the workers requests depend on are checked


class ClusterBackend(Backend):
    def __init__(
        self,
        auth: FrameAuth,
        inbox_bind: str,
        *,
        kv_transport: str = DEFAULT_KV_TRANSPORT,
        dead_after_s: float = 2.0,
        stuck_after_s: float = STUCK_AFTER_S,
        reserve_timeout_s: float = 5.0,
        on_decode_failure: str = DEFAULT_ON_DECODE_FAILURE,
        max_attempts: int = 3,
        queue_limits: QueueLimits = QueueLimits(),
        local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS,
        router: RouterPolicy = DEFAULT_ROUTER,  # gateway/router.py
        prefill_placement: PrefillPlacement = DEFAULT_PREFILL_PLACEMENT,  # gateway/prefill_placement.py
        worker_advertise: str | None = None,
        allow_wildcard_bind: bool = False,
    ) -> None:
        if kv_transport not in KV_TRANSPORTS:
            raise ValueError("kv_transport must be auto, shm, cuda-ipc or zmq")
        if on_decode_failure not in ("migrate", "fail"):
            raise ValueError("on_decode_failure must be migrate or fail")
        self.auth = auth
        self.worker_advertise = worker_advertise  # the worker-plane address /cluster/join hands out
        self.gateway_id = f"gw-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"
        self.plane = WorkerPlane(auth, inbox_bind, allow_wildcard_bind)
        self.table = WorkerTable(dead_after_s=dead_after_s, stuck_after_s=stuck_after_s)
        self._reported_gone: set[str] = set()  # workers whose loss was logged (once each)
        self.members = ClusterMembers(self.plane, self.gateway_id, self.table, self._notify_queues)
        self.requests = RequestTable()
        # where each prompt is prefilled; at most local_prefill_max_tokens on a decode worker under auto
        self.router = Router(router, local_prefill_max_tokens, prefill_placement)
        self.queue_wait = Histogram(
            "pdserve_queue_wait_seconds",
            "Time a request waited in a pool's queue",
            ["pool"],
            buckets=_WAIT_BUCKETS,
            registry=None,
        )
        self.reconciled = Counter(
            "pdserve_requests_reconciled",
            "Requests the gateway ended or moved because nothing else would have: their workers no "
            "longer named them (migrated: run again or continued on a live pair; failed: ended with "
            "an error), or they waited in a queue past its deadline (queue_timeout)",
            ["outcome"],
            registry=None,
        )
        for outcome in ("migrated", "failed", "queue_timeout"):
            self.reconciled.labels(outcome=outcome)
        on_timeout = self._count_reconciled
        self._queues: dict[str, AdmissionQueue[Any]] = {
            "disaggregated": AdmissionQueue(
                "disaggregated", queue_limits, self._free_decode_seats, self._observe_wait, on_timeout
            ),
            "colocated": AdmissionQueue(
                "colocated", queue_limits, self._free_colocated_seats, self._observe_wait, on_timeout
            ),
        }
        self.disaggregated = DisaggregatedFlow(
            self.members,
            self.requests,
            self.router,
            self._queues["disaggregated"],
            kv_transport=kv_transport,
            reserve_timeout_s=reserve_timeout_s,
            on_decode_failure=on_decode_failure,
            max_attempts=max_attempts,
            on_release=self._notify_queues,
            on_reconciled=self._count_reconciled,
        )
        self.colocated = ColocatedFlow(
            self.members,
            self.requests,
            self.router,
            self._queues["colocated"],
            self._notify_queues,
            on_reconciled=self._count_reconciled,
        )
        self._tasks: list[asyncio.Task] = []
        self._flows: set[asyncio.Task] = set()  # one per running request

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self.plane.start(self._dispatch)
        self._tasks = [asyncio.create_task(self._retry_queues()), asyncio.create_task(self._check_liveness())]
        log.info("gateway %s listening for workers on %s", self.gateway_id, self.plane.addr)

    async def stop(self) -> None:
        for task in [*self._tasks, *self._flows]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._flows, return_exceptions=True)
        await self.plane.stop()

    @property
    def inbox_addr(self) -> str:
        return self.plane.addr

    async def _retry_queues(self) -> None:
        """A waiting request gets a turn at least once a second even when no event says capacity
        changed (a pool that lost every worker: its waiters learn it and get a 503)."""
        while True:
            await asyncio.sleep(1.0)
            self._notify_queues()

    async def _check_liveness(self) -> None:
        while True:
            asked = time.monotonic()
            await asyncio.sleep(LIVENESS_CHECK_S)
            late = time.monotonic() - asked - LIVENESS_CHECK_S
            if late > LIVENESS_CHECK_S:  # this loop was away: the heartbeats queued meanwhile are unread
                log.warning("the gateway's loop was %.1f s late; not counted against the workers", late)
                self.table.credit_pause(late)
            self.check_liveness()

    def check_liveness(self) -> None:
        """A request whose worker stopped heartbeating (or deregistered) learns it here: its
        attempt ends with WorkerLost (gateway/request_flow.py migrates it). So does one that its
        live workers no longer hold (their heartbeats name what they hold: gateway/reconcile.py)."""
        now = time.monotonic()
        for rec in self.requests:
            gone = [w for w in rec.watched() if not self.table.is_live(w, now)]
            if gone:
                for w in gone:
                    if w.worker_id not in self._reported_gone:
                        self._reported_gone.add(w.worker_id)
                        log.warning("worker %s counted gone: %s", w.worker_id, self.table.why_gone(w, now))
                rec.end_attempt(WorkerLost([w.worker_id for w in gone]))
        for rec in forgotten(self.requests):
            workers = [w.worker_id for w in rec.watched()]
            log.warning(
                "request %s (%s): %s no longer named it in %d heartbeats in a row; ending its attempt",
                rec.request_id,
                rec.worker_request_id,
                ", ".join(workers),
                rec.missed_rounds,
            )
            rec.end_attempt(RequestForgotten(workers))

    def _count_reconciled(self, outcome: str) -> None:
        self.reconciled.labels(outcome=outcome).inc()

    # --- every message from the workers -------------------------------------------------------
    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, TokenOutputBatch):  # the token path: each output to its record
            get = self.requests.get
            for out in msg.outputs:
                rec = get(out.request_id)
                if rec is not None:
                    rec.accept(out)
        elif isinstance(msg, TokenOutput):
            rec = self.requests.get(msg.request_id)
            if rec is not None:
                rec.accept(msg)
        elif isinstance(msg, LeaseRenewed):  # D -> P: the prefill worker holding it may write longer
            rec = self.requests.get(msg.request_id)
            if rec is not None and rec.state == "prefilling" and rec.prefill is not None:
                if rec.decode is not None and rec.decode.worker_id == msg.worker_id:
                    rec.lease_deadline = max(rec.lease_deadline, msg.deadline)
                    self.plane.send(rec.prefill.worker_id, msg)
        elif isinstance(msg, ReserveReply):
            rec = self.requests.get(msg.request_id)
            fut = rec.reservation if rec is not None else None
            if fut is not None and not fut.done():
                fut.set_result(msg)
            elif msg.lease is not None or msg.local:  # nobody waits for it any more: hand it back
                abort = Abort(request_id=msg.request_id, reason="lease not used", lease_unused=True)
                self.plane.send(msg.worker_id, abort)
        elif isinstance(msg, Deregister):
            self.members.on_deregister(msg)
        elif isinstance(msg, (Register, Heartbeat)):
            self.members.on_register_or_heartbeat(msg)

    # --- admission --------------------------------------------------------------------------
    def _notify_queues(self) -> None:
        for queue in self._queues.values():
            queue.notify()

    def _free_decode_seats(self) -> int:
        """This gateway's estimate of how many more requests the decode pool can take now."""
        return sum(max(0, d.info.max_num_seqs - d.inflight - d.reserving) for d in self.table.live("decode"))

    def _free_colocated_seats(self) -> int:
        return self.colocated.free_seats()

    def _observe_wait(self, pool: str, seconds: float) -> None:
        self.queue_wait.labels(pool=pool).observe(seconds)

    def _first_output(self, rec: RequestRecord, out: TokenOutput) -> None:
        if "prefill_queue_s" in out.timings:
            self._observe_wait("prefill", out.timings["prefill_queue_s"])
        if rec.decode is not None and rec.decode.info.role == "decode":  # (not colocated)
            self.disaggregated.observe_first_output(rec, out)

    # --- Backend API ------------------------------------------------------------------------
    def open(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, stream: OutputStream
    ) -> None:
        try:
            if sampling.is_group:
                self._check_group_fits(len(prompt_token_ids), sampling)
            if self.table.live("prefill") and self.table.live("decode"):
                flow = self.disaggregated.run
            elif self.table.live("colocated"):
                flow = self.colocated.run
            else:
                raise BackendUnavailable(
                    "no live workers: need a prefill and a decode worker, or a colocated worker", retry_after_s=2.0
                )
        except BackendUnavailable as e:  # refused before any work: the reader's first get raises it
            stream.end(e)
            return
        rec = RequestRecord(request_id, prompt_token_ids, sampling, stream, on_first_output=self._first_output)
        task = asyncio.create_task(flow(rec))
        self._flows.add(task)
        task.add_done_callback(self._flows.discard)
        stream.on_abort, stream.upstream = (
            task.cancel,
            task,
        )  # the reader left, or was cut: the flow's end aborts it upstream

    def stop_choice(self, request_id: str, index: int) -> None:
        # (a group that migrates later reruns every member; the gateway drops this one's tokens)
        rec = self.requests.find(request_id)
        if rec is not None and rec.decode is not None:
            abort = Abort(request_id=rec.worker_request_id, reason="stop string", seq_index=index)
            self.plane.send(rec.decode.worker_id, abort)

    def _check_group_fits(self, prompt_len: int, sampling: SamplingParams) -> None:
        """A group whose sequences at full length (sharing only the prompt's full blocks) need
        more KV blocks than any live decode (or colocated) worker has is refused now, with 400,
        not after its prefill (the engine checks the same, SamplingParams.worst_case_blocks)."""
        pool = self.table.live("decode") or self.table.live("colocated")
        if not pool:
            return  # (no worker: open() answers 503)
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

    def health(self) -> tuple[bool, dict]:
        live = {role: len(self.table.live(role)) for role in ("prefill", "decode", "colocated")}
        ok = (live["prefill"] > 0 and live["decode"] > 0) or live["colocated"] > 0
        return ok, {"live_workers": live}

    def worker_stats(self) -> dict[str, WorkerStats]:
        stats = {wid: w.stats for wid, w in self.table.workers.items() if self.table.is_live(w)}
        if self.plane.inbox is not None:  # the gateway's own inbox
            stats[self.gateway_id] = WorkerStats(dropped_frames=self.plane.dropped_frames())
        return stats

    def queue_stats(self) -> dict[str, QueueStats]:
        stats = {pool: q.stats() for pool, q in self._queues.items()}
        # handed to prefill workers, no first token yet: queued there or computing
        queued = self.disaggregated.queued_prefill_tokens()
        at_prefill = sum(1 for r in self.requests if r.state == "prefilling" and r.prefill is not None)
        stats["prefill"] = QueueStats(at_prefill, sum(queued.values()))
        return stats

    def collectors(self) -> list:
        return [self.queue_wait, self.reconciled]

    def workers(self) -> list[dict]:
        return self.members.listing()

    def join(self, body: bytes, url_host: str) -> JoinAnswer:
        claim = check_join(self.auth, body)
        addr = worker_plane_addr(self.inbox_addr, self.worker_advertise, url_host)
        log.info("a %s worker on %s asked to join: sent to %s", claim.role, claim.host, addr)
        return JoinAnswer(gateway_id=self.gateway_id, worker_addr=addr)

    def routed_requests(self) -> dict[str, int]:
        return {wid: w.inflight for wid, w in self.table.workers.items() if self.table.is_live(w)}
