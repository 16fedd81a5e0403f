"""Decode worker process: grants KV leases, receives prefilled KV, runs continuous batching.

Block ownership on this worker:
    pool --allocate--> lease (ReserveRequest) --KvDone ok--> running sequence --finish--> pool
                         +--abort/expiry--> quarantine until the lease deadline --> pool
A quarantined block is never handed out before its lease deadline, so a late or replayed
transfer cannot land in blocks that belong to another request. A KvDone that arrives while
frames are missing (dropped, late, tampered: the receiver refused them) ends the request with an
error at once and frees its lease: KvDone is P's last message for it.

`kv_advertise`: the KV address put in the registration for prefill workers to connect to
(default: the bound one), e.g. a NAT/forwarded address or a test's fault-injection relay.
`kv_payload_mac` ("auto", "on", "off"): require an HMAC tag over each KV payload's bytes
(kvtransfer/wire.py); auto = on when the KV inbox is tcp://.
`idle_threads`: torch threads for steps taken while no prefill for this worker is in flight
(decode_node/thread_lending.py); default: the worker's thread count, i.e. no lending.
`step_interval_ms`: while prompts for this worker queue behind a prefill, space decode steps up
to this far apart, more the longer the queue (decode_node/step_pacing.py); 0 = back to back.
"""
from __future__ import annotations

import logging
import signal
import time

import torch
import zmq

from pdserve.decode_node.step_pacing import StepPacer
from pdserve.decode_node.thread_lending import ThreadLending
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.kvtransfer.wire import payload_mac_enabled
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import (
    Abort,
    KvDone,
    LeaseRenewed,
    ReserveReply,
    ReserveRequest,
    TokenOutput,
    Welcome,
    WorkerStats,
)
from pdserve.runtime.worker_runtime import WorkerRuntime, describe_worker, engine_stats

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 30.0


class DecodeWorker:
    def __init__(self, config: EngineConfig, auth: FrameAuth, control_bind: str, kv_bind: str,
                 gateway_addrs: list[str], *, shared_memory: bool = True, host: str = "127.0.0.1",
                 lease_ttl_s: float = DEFAULT_LEASE_TTL_S, kv_advertise: str | None = None,
                 kv_payload_mac: str = "auto", idle_threads: int | None = None,
                 step_interval_ms: float = 0.0) -> None:
        self._shm: SharedTensor | None = None

        def shm_allocator(shape, dtype):
            self._shm = SharedTensor.create(shape, dtype)
            return self._shm.tensor

        self.engine = LLMEngine(config, kv_allocator=shm_allocator if shared_memory else None)
        self.ctx = zmq.Context()
        self.rt = WorkerRuntime(self.ctx, auth, control_bind, gateway_addrs)
        self.leases = LeaseTable(self.engine.model_config.num_layers)
        self.lease_ttl_s = lease_ttl_s
        self.receiver = KvReceiver(self.ctx, auth, kv_bind, self.engine.kv_cache, self.leases,
                                   payload_mac=payload_mac_enabled(kv_payload_mac, kv_bind, kv_advertise))
        self.rt.info = describe_worker(self.engine, "decode", self.rt.control_addr, host,
                                       kv_addr=kv_advertise or self.receiver.addr,
                                       shm_name=self._shm.name if self._shm else None)
        self.gateway_of: dict[str, str] = {}  # request id -> gateway id
        # leases revoked by an abort, quarantined until their deadline: request id -> (epoch,
        # deadline). An `Abort(lease_unused)` (the gateway knows their writer is gone) frees them now.
        self._revoked: dict[str, tuple[int, float]] = {}
        self._revoked_pruned = 0.0
        self.admitted_at: dict[str, float] = {}
        self._stop = False
        self._last_progress = time.monotonic()
        busy = torch.get_num_threads()
        self.threads = ThreadLending(busy, max(busy, idle_threads or busy))
        self.pacer = StepPacer(step_interval_ms)

    @property
    def worker_id(self) -> str:
        return self.rt.info.worker_id

    # --- reservations -----------------------------------------------------------------------
    def _on_reserve(self, req: ReserveRequest) -> None:
        if req.to_worker and req.to_worker != self.worker_id:
            log.info("ignoring reservation %s meant for %s", req.request_id, req.to_worker)
            return  # queued for a previous worker on this address
        eng = self.engine
        n_blocks = -(-req.num_prompt_tokens // eng.block_size)
        seats = eng.config.scheduler.max_num_seqs - len(eng.scheduler.running) - self.leases.num_active
        reason, full = "", False  # full: refused for lack of room now, worth retrying later
        if req.request_id in self.gateway_of or self.leases.get(req.request_id) is not None:
            reason = "duplicate request id"
        elif req.num_prompt_tokens + req.max_tokens > eng.max_model_len:
            reason = f"prompt + max_tokens exceeds max_model_len {eng.max_model_len}"
        elif seats <= 0:
            reason, full = "no free decode seats", True
        elif not eng.pool.can_allocate(n_blocks):
            reason, full = f"no KV blocks ({n_blocks} needed, {eng.pool.num_free} free)", True
        if reason:
            self.rt.to_gateway(req.gateway_id, ReserveReply(request_id=req.request_id, worker_id=self.worker_id,
                                                            reason=reason, capacity=full))
            return
        lease = self.leases.grant(req.request_id, eng.pool.allocate(n_blocks), self.lease_ttl_s)
        self.gateway_of[req.request_id] = req.gateway_id
        self.rt.to_gateway(req.gateway_id, ReserveReply(request_id=req.request_id,
                                                        worker_id=self.worker_id, lease=lease))

    def _on_kv_done(self, done: KvDone) -> None:
        lease = self.leases.get(done.request_id)
        gateway = self.gateway_of.get(done.request_id)
        if lease is None or gateway is None:
            return
        self.leases.release(done.request_id)  # blocks now belong to the sequence
        self.admitted_at[done.request_id] = time.monotonic()
        try:
            finished = self.engine.add_prefilled(done.request_id, done.prompt_token_ids, done.first_token,
                                                 done.first_logprob, done.sampling, lease.block_ids)
        except ValueError as e:  # e.g. a prompt that does not fit: give the blocks back, report
            self.engine.pool.free(lease.block_ids)
            self._emit(done.request_id, [], None, "error", 1, error=str(e))
            return
        if finished is not None:
            self._emit(done.request_id, [], None, finished.finish_reason, 1)

    def _on_kv_failed(self, done: KvDone, reason: str) -> None:
        """P finished the transfer but some of it never landed (frames dropped, late or
        rejected): free the lease now (P writes it no more) and end the request with an error."""
        blocks = self.leases.release_early(done.request_id, done.lease_epoch)
        if not blocks:
            return  # not this lease's epoch (a stale or replayed KvDone): nothing to end
        self.engine.pool.free(blocks)
        self._emit(done.request_id, [], None, "error", 1,
                   error=f"KV transfer failed on the decode worker ({reason}: frames missing or rejected)")

    def _on_abort(self, request_id: str, lease_unused: bool = False) -> None:
        lease = self.leases.get(request_id)
        if lease_unused and lease is not None:  # never handed to a prefill worker: free now
            self.engine.pool.free(self.leases.release_early(request_id, lease.epoch))
        elif lease_unused and request_id in self._revoked:  # its writer is gone for good
            epoch, _ = self._revoked.pop(request_id)
            self.engine.pool.free(self.leases.release_early(request_id, epoch))
        elif not self.engine.abort(request_id) and lease is not None:
            self.leases.revoke(request_id)  # its blocks wait out the deadline in quarantine
            self._revoked[request_id] = (lease.epoch, lease.deadline)
        self.gateway_of.pop(request_id, None)
        self.admitted_at.pop(request_id, None)

    def _report_renewals(self) -> None:
        """Leases a prefill worker renewed (it still holds their requests): tell it, through the
        request's gateway, the deadline it may now write by."""
        for request_id, lease in self.receiver.renewed:
            gateway = self.gateway_of.get(request_id)
            if gateway is not None:
                self.rt.to_gateway(gateway, LeaseRenewed(request_id=request_id, worker_id=self.worker_id,
                                                         lease_epoch=lease.epoch, deadline=lease.deadline))
        self.receiver.renewed.clear()

    def _reclaim(self) -> None:
        now = time.time()
        for request_id in self.leases.expire(now):
            gateway = self.gateway_of.pop(request_id, None)
            if gateway is not None:
                self.rt.to_gateway(gateway, TokenOutput(request_id=request_id, worker_id=self.worker_id,
                                                        finish_reason="error",
                                                        error="KV transfer did not complete before the lease deadline"))
        blocks = self.leases.reclaimable(now)
        if blocks:
            self.engine.pool.free(blocks)
        if self._revoked and now > self._revoked_pruned + 1.0:  # past the deadline: settled anyway
            self._revoked_pruned = now
            self._revoked = {r: v for r, v in self._revoked.items() if now <= v[1] + self.leases.grace_s}

    # --- outputs (held, then sent one frame a gateway by rt.flush_outputs) --------------------
    def _emit(self, request_id, tokens, logprobs, reason, index, timings=None, error=None) -> None:
        gateway = self.gateway_of.get(request_id)
        if gateway is None:
            return
        self.rt.hold_output(gateway, TokenOutput(request_id=request_id, worker_id=self.worker_id,
                                                 index=index, token_ids=tokens, logprobs=logprobs,
                                                 finish_reason=reason, error=error, timings=timings or {}))
        if reason is not None:
            self.gateway_of.pop(request_id, None)
            self.admitted_at.pop(request_id, None)

    def step(self) -> None:
        self.rt.mark_step()
        self.threads.update(prefills_in_flight=self.leases.num_active)
        now = time.monotonic()
        self.pacer.started(now)
        for out in self.engine.step():
            timings = None
            admitted = self.admitted_at.pop(out.request_id, None)
            if admitted is not None:
                timings = {"decode_admission_s": now - admitted}
            self._emit(out.request_id, out.new_token_ids, out.logprobs, out.finish_reason,
                       out.seq.num_output_tokens - len(out.new_token_ids), timings)
        self.rt.flush_outputs()
        self._last_progress = time.monotonic()

    def stats(self) -> WorkerStats:
        dropped = sum(self.rt.inbox.dropped.values()) + sum(self.receiver.dropped.values())
        return engine_stats(self.engine, self._last_progress, dropped, extra_waiting=self.leases.num_active,
                            leases_active=self.leases.num_active,
                            kv_blocks_quarantined=self.leases.num_quarantined_blocks,
                            lease_renewals=self.leases.num_renewals)

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "_stop", True))
        log.info("decode worker %s on %s (kv %s, advertised %s, payload mac %s, shm %s, threads %d%s%s)",
                 self.worker_id, self.rt.control_addr, self.receiver.addr, self.rt.info.kv_addr,
                 self.receiver.payload_mac, self._shm.name if self._shm else None, self.threads.busy,
                 f", {self.threads.idle} while no prefill is in flight" if self.threads.enabled else "",
                 f", steps up to {self.pacer.max_interval_s * 1000:g} ms apart while prompts queue" if self.pacer.enabled else "")
        poller = zmq.Poller()
        poller.register(self.rt.inbox.socket, zmq.POLLIN)
        poller.register(self.receiver.socket, zmq.POLLIN)
        try:
            wait_ms = 0
            while not self._stop:
                if wait_ms:  # sleep on both inboxes: no work, or (paced) the next step is not due
                    poller.poll(wait_ms)
                for msg in self.rt.drain(0):
                    if isinstance(msg, ReserveRequest):
                        self._on_reserve(msg)
                    elif isinstance(msg, Abort):
                        self._on_abort(msg.request_id, msg.lease_unused)
                    elif isinstance(msg, Welcome):
                        self.rt.handle_welcome(msg)
                for done in self.receiver.poll(0):
                    self._on_kv_done(done)
                for done, reason in self.receiver.failed_done:
                    self._on_kv_failed(done, reason)
                self.receiver.failed_done.clear()
                if self.receiver.released:  # leases P gave back early: reusable now
                    self.engine.pool.free(self.receiver.released)
                    self.receiver.released.clear()
                self._report_renewals()
                self._reclaim()
                self.rt.flush_outputs()  # what the handlers above emitted (errors, early finishes)
                wait_ms = self.pacer.delay_ms(self.leases.num_active) if self.engine.has_work() else 20
                if wait_ms == 0:
                    self.step()
                self.rt.tick(self.stats)
        finally:
            self.close()

    def close(self) -> None:
        self.receiver.close()
        self.rt.close()
        self.ctx.term()
        if self._shm is not None:
            self._shm.close()
