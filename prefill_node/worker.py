"""Prefill worker process: batches prompts (ragged, chunked), streams KV to decode workers,
sends each request's first token to its gateway (that is TTFT) and `KvDone` to its decode worker.

The loop (this thread) owns the sockets and calls the engine; it launches steps while a lane is
free and its lanes (prefill_node/lanes.py) run them a layer at a time, the idle lanes on cycles
no other process on the machine wants.

Leases: a request may wait here, queued behind other prompts, for longer than its decode
worker's lease lives. The loop renews the lease of every request it still holds once less than
half its ttl is left (`KvRenew` on the KV stream) and writes by a new deadline only when
`LeaseRenewed` comes back (kvtransfer/lease.py), so no request fails on the lease clock while
this worker makes progress; a stuck or dead worker stops renewing and its leases run out.

Prefix sharing (prefill_node/prefix_sharing.py): peers fetch the prompt blocks this worker's
prefix cache holds from its export socket, and a request whose gateway names a peer holding more of
its prompt waits here, off the loop, for those blocks (at most the fetch's deadline) before it is
queued; what did not come is computed.

Settings (prefill_node/settings.py): lanes, idle lanes, whether KV payloads carry a MAC, and
prefix sharing's socket.
"""

from __future__ import annotations

import logging
import threading
import time

import msgspec

from pdserve import tracing
from pdserve.engine.engine_core import PREFILLED, EngineCore, start_engine, wire_finish_reason
from pdserve.kvtransfer.sender_cache import KvSenderCache
from pdserve.prefill_node.kv_streamer import KvStreamer
from pdserve.prefill_node.lane_split import step_budget_for_lanes
from pdserve.prefill_node.lanes import LaneJob, PrefillLanes
from pdserve.prefill_node.prefix_sharing import PrefixSharing
from pdserve.prefill_node.request_record import PrefillRecord
from pdserve.prefill_node.settings import PrefillSettings
from pdserve.protocol import kv_rows
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import (
    Abort,
    LeaseRenewed,
    PrefillRequest,
    TokenOutput,
    WorkerStats,
)
from pdserve.runtime.worker_base import WorkerBase
from pdserve.runtime.worker_runtime import HeldRequests, PrefixCacheReport, describe_worker, engine_stats

log = logging.getLogger(__name__)

RENEW_CHECK_INTERVAL_S = 0.1
HANDED_OVER_S = 10.0  # a request let go is still named in heartbeats this long (gateway/reconcile.py)


class PrefillWorker(WorkerBase):
    role = "prefill"

    def __init__(self, settings: PrefillSettings, auth: FrameAuth) -> None:
        super().__init__(settings, auth)
        tp = settings.engine.tensor_parallel_size > 1  # then each rank sends its own KV heads
        self.engine: EngineCore = start_engine(
            settings.engine,
            rank_kv_sends=settings.kv_payload_mac if tp else None,
            on_layer_done=self.rt.mark_progress,  # a long step's layers: progress
        )
        info = self.engine.info
        worker = describe_worker(info, "prefill", self.rt.control_addr, settings.host)
        # peers fetch what its prefix cache holds; it fetches what a peer holds (prefix_sharing.py)
        self.sharing: PrefixSharing | None = None
        if settings.prefix_sharing and info.shares_prefixes:
            args = (self.engine, self.ctx, auth, settings.prefix_export_bind, settings.kv_payload_mac, worker.kv_layout)
            self.sharing = PrefixSharing(*args)
            worker = msgspec.structs.replace(worker, export_addr=self.sharing.addr)
        self.describe(worker)
        if info.caches_prefixes:
            self.kv_report = PrefixCacheReport(self.engine)
        self.handlers.update(
            {
                PrefillRequest: self._on_prefill,
                Abort: self._on_abort,
                LeaseRenewed: self._on_lease_renewed,
            }
        )
        self.requests: dict[str, PrefillRecord] = {}  # by request id, until KvDone or release
        self.senders = KvSenderCache(self.ctx, auth, settings.kv_payload_mac)  # one per decode worker
        self._send_lock = threading.Lock()  # senders are shared by this loop and the lanes
        self.streamer = KvStreamer(
            self.engine.kv_cache,
            info.block_size,
            self._send_lock,
            self.engine.kv_head_shards,
            self.engine.draft_kv_cache,
            rank_sends=tp,
        )
        # the draft's fingerprint a decode worker's layout must name to get the draft's KV too
        self.draft_fingerprint = info.draft_fingerprint
        self.lanes = PrefillLanes(self.engine, settings.lanes, settings.idle_lanes)
        self._abort_after: set[str] = set()  # aborted while a lane computes its chunk
        # requests let go (KV and first token handed over, or ended) -> when: still named in
        # heartbeats for HANDED_OVER_S, while their KvDone travels to the decode worker
        self._handed: dict[str, float] = {}
        self._renew_checked = 0.0

    # --- messages -----------------------------------------------------------------------------
    def _on_prefill(self, req: PrefillRequest) -> None:
        try:
            lease = req.dest.lease
            if req.dest.layout.dtype != self.engine.info.kv_dtype:  # (the gateway pairs by fingerprint, which names it)
                raise ValueError(
                    f"KV cache dtype mismatch: this prefill worker stores {kv_rows.describe(self.engine.info.kv_dtype)}, "
                    f"the decode worker {kv_rows.describe(req.dest.layout.dtype)} (--kv-cache-dtype must agree)"
                )
            if (len(lease.prefix_block_ids) + len(lease.block_ids)) * self.engine.info.block_size < len(
                req.prompt_token_ids
            ):
                raise ValueError("lease holds too few blocks for the prompt")
            fetching = self.sharing is not None and self.sharing.begin(req)
            if not fetching:  # (else queued once its blocks are in: _after_fetches)
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.sampling, prefill_only=True)
        except ValueError as e:
            self._refuse(req, str(e))
            return
        ships_draft = self.draft_fingerprint is not None and req.dest.layout.draft_fingerprint == self.draft_fingerprint
        self.requests[req.request_id] = PrefillRecord(
            req, self.senders.get(req.dest), time.monotonic(), ships_draft=ships_draft
        )

    def _refuse(self, req: PrefillRequest, error: str) -> None:
        """The request cannot run here: an error to its gateway, its lease back to its decoder."""
        self.rt.to_gateway(
            req.gateway_id,
            TokenOutput(request_id=req.request_id, worker_id=self.worker_id, finish_reason="error", error=error),
        )
        with self._send_lock:
            self.senders.get(req.dest).send_release(req.request_id, req.dest.lease.epoch)

    def _after_fetches(self) -> None:
        """Queue the requests whose prefix fetch ended (their fetched blocks now cached here)."""
        assert self.sharing is not None
        for done in self.sharing.collect():
            req = done.req
            r = self.requests.get(req.request_id)
            if r is None or r.req is not req:
                continue  # (ended meanwhile)
            r.fetched_blocks, r.fetch_bytes, r.fetch_s = done.blocks, done.nbytes, done.seconds
            try:
                self.engine.add_request(req.request_id, req.prompt_token_ids, req.sampling, prefill_only=True)
            except ValueError as e:
                self.requests.pop(req.request_id, None)
                self._refuse(req, str(e))

    # --- lease renewal ----------------------------------------------------------------------
    def _renew_leases(self) -> None:
        """Ask for more time on every held lease with less than half its ttl left (again each
        quarter ttl while no answer comes). Requests being aborted are not renewed."""
        now = time.time()
        if now < self._renew_checked + RENEW_CHECK_INTERVAL_S:
            return
        self._renew_checked = now
        for request_id, r in self.requests.items():
            lease = r.dest.lease
            if (
                lease.ttl_s <= 0
                or request_id in self._abort_after
                or lease.deadline - now > lease.ttl_s / 2
                or now - r.renew_sent < lease.ttl_s / 4
            ):
                continue
            r.renew_sent = now
            with self._send_lock:
                r.sender.send_renew(request_id, lease.epoch)

    def _on_lease_renewed(self, msg: LeaseRenewed) -> None:
        r = self.requests.get(msg.request_id)
        if r is None:
            return
        dest = r.dest
        if (
            msg.worker_id != dest.worker_id
            or msg.lease_epoch != dest.lease.epoch
            or msg.deadline <= dest.lease.deadline
        ):
            return
        lease = msgspec.structs.replace(dest.lease, deadline=msg.deadline)
        r.dest = msgspec.structs.replace(dest, lease=lease)

    def _release(self, request_id: str) -> None:
        """This request will never hand its KV over: let its decode worker reclaim the lease now."""
        r = self.requests.get(request_id)
        if r is not None:
            with self._send_lock:
                r.sender.send_release(request_id, r.dest.lease.epoch)

    def _forget(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self._handed[request_id] = time.monotonic()

    def _in_flight(self, request_id: str) -> bool:
        seq = self.engine.find(request_id)
        return seq is not None and id(seq) in self.lanes.busy_sequences()

    def _on_abort(self, msg: Abort) -> None:
        if msg.seq_index is None:  # (one member of a group is the decode worker's to stop)
            self._abort(msg.request_id)

    def _abort(self, request_id: str) -> None:
        if self._in_flight(request_id):  # a lane is writing its blocks: abort once it is done
            self._abort_after.add(request_id)
            return
        self._abort_after.discard(request_id)
        if self.sharing is not None:
            self.sharing.forget(request_id)
        self.engine.abort(request_id)
        self._release(request_id)
        self._forget(request_id)

    # --- the loop ---------------------------------------------------------------------------
    def launch(self) -> bool:
        """Launch steps while a lane is free; returns whether any was launched."""
        launched = False
        info = self.engine.info
        while (free := self.lanes.capacity - self.lanes.in_flight()) > 0:
            queued = self.engine.queued_prompt_tokens()
            budget = step_budget_for_lanes(queued, free, info.max_num_batched_tokens, info.block_size)
            sched = self.engine.schedule_prefill(self.lanes.busy_sequences(), budget)
            if sched.is_empty:
                break
            self.rt.mark_step()
            now = time.monotonic()
            for c in sched.prefills:
                r = self.requests.get(c.seq.request_id)
                if r is not None and r.first_scheduled is None:
                    r.first_scheduled = now
            transfers = self.streamer.prepare(sched, self.requests)
            self.lanes.submit(sched, self.engine.launch(sched, transfers))
            launched = True
        return launched

    def complete(self, job: LaneJob) -> None:
        """A step's layers are done: sample, then first tokens to gateways and KvDone to decoders."""
        if job.error is not None:
            raise RuntimeError("prefill step failed in a lane") from job.error
        outputs = self.engine.finish_step(job.fp, job.logits)
        done_at = time.monotonic()
        self._last_progress = done_at
        for out in outputs:
            r = self.requests.get(out.request_id)
            if r is None or out.request_id in self._abort_after:
                continue
            req, ts, started = r.req, r.transfer, r.first_scheduled or r.received
            timings = {
                "prefill_queue_s": started - r.received,
                "prefill_compute_s": done_at - started,
                "kv_transfer_s": ts.seconds,
                "kv_bytes": float(ts.bytes),
            }
            if r.fetch_s > 0:  # its leading blocks fetched from a peer (within prefill_queue_s)
                timings |= {"prefix_fetch_s": r.fetch_s, "prefix_fetch_bytes": float(r.fetch_bytes)}
            self._trace(r, done_at, out.num_cached_tokens)
            info = self.engine.info  # its layers (+ the draft's when they went too)
            num_layers = info.num_layers + (info.draft_num_layers if r.ships_draft else 0)
            if ts.error is not None:  # the decode side never got its KV: fail the request
                self.rt.to_gateway(
                    req.gateway_id,
                    TokenOutput(
                        request_id=req.request_id,
                        worker_id=self.worker_id,
                        finish_reason="error",
                        error=ts.error,
                        timings=timings,
                    ),
                )
            elif out.fork is not None:  # a group: D forks it and sends all its tokens
                done = r.kv_done(out.fork[0].token_id, None, num_layers, timings, out.fork, out.prompt_logprobs)
                with self._send_lock:
                    r.sender.send_done(done)
            else:
                lp = out.logprobs[0] if out.logprobs else None
                if out.finish_reason == PREFILLED:
                    with self._send_lock:
                        r.sender.send_done(r.kv_done(out.new_token_ids[0], lp, num_layers, timings))
                else:  # ended at its first token (stop/length): D's lease is not needed
                    self._release(out.request_id)
                self.rt.to_gateway(
                    req.gateway_id,
                    TokenOutput(
                        request_id=req.request_id,
                        worker_id=self.worker_id,
                        index=0,
                        token_ids=out.new_token_ids,
                        logprobs=out.logprobs,
                        finish_reason=wire_finish_reason(out.finish_reason),
                        timings=timings,
                        cached_tokens=out.num_cached_tokens,
                        prompt_logprobs=out.prompt_logprobs,
                    ),
                )
            self._forget(out.request_id)
        for request_id in list(self._abort_after):
            self._abort(request_id)

    @staticmethod
    def _trace(r: PrefillRecord, done_at: float, cached: int) -> None:
        """This worker's stages of a traced request (pdserve/tracing.py)."""
        req, ts = r.req, r.transfer
        if not req.traceparent or not tracing.enabled():
            return
        started = r.first_scheduled or r.received
        tracing.record_span("prefill.queue", req.traceparent, r.received, started)
        tracing.record_span(
            "prefill.compute",
            req.traceparent,
            started,
            done_at,
            attributes={"pdserve.prompt_tokens": len(req.prompt_token_ids), "pdserve.cached_tokens": cached},
        )
        now = time.monotonic()  # the time its KV frames took to send (they overlap the compute)
        tracing.record_span(
            "kv.transfer", req.traceparent, now - ts.seconds, now, attributes={"pdserve.kv_bytes": ts.bytes}
        )

    def stats(self) -> WorkerStats:
        sharing = self.sharing.stats() if self.sharing is not None else {}
        return engine_stats(self.engine.stats(), self._last_progress, sum(self.rt.inbox.dropped.values()), **sharing)

    def has_work(self) -> bool:
        return bool(self.requests) or self.engine.has_work()

    def held_requests(self) -> HeldRequests:
        """Requests queued or computing, and those handed over in the last HANDED_OVER_S (the
        gateway may not have heard from the decode worker yet that it admitted them)."""
        cutoff = time.monotonic() - HANDED_OVER_S
        if self._handed:
            self._handed = {r: t for r, t in self._handed.items() if t > cutoff}
        return [*self.requests, *self._handed], []

    def describe_start(self) -> str:
        return f"{self.lanes.capacity - self.lanes.num_idle} lanes, {self.lanes.num_idle} idle lanes"

    def run_once(self) -> None:
        launched = self.launch()
        # sleep on the inbox, the lanes' wake-up pipe (a step finished), and prefix sharing's
        # socket and pipe (a peer's fetch, one of ours ended)
        wake = [self.lanes.wake_fd, *(self.sharing.wake if self.sharing is not None else [])]
        for msg in self.rt.drain(0 if launched else 20, wake):
            self.dispatch(msg)
        if self.sharing is not None:
            self.sharing.serve()
            self._after_fetches()
        for job in self.lanes.collect():
            self.complete(job)
        self._renew_leases()

    def close(self) -> None:
        self.lanes.close()
        self.senders.close()
        if self.sharing is not None:
            self.sharing.close()
        super().close()
