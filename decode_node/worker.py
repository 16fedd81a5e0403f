"""Decode worker process: grants KV leases, receives prefilled KV, runs continuous batching.

Block ownership on this worker:
    pool --allocate--> lease (ReserveRequest) --KvDone ok--> running sequence --finish--> pool
                         +--abort/expiry--> quarantine until the lease deadline --> pool
A quarantined block is never handed out before its lease deadline, so a late or replayed
transfer cannot land in blocks that belong to another request. A KvDone that arrives while
frames are missing (dropped, late, tampered: the receiver refused them) ends the request with an
error at once and frees its lease: KvDone is P's last message for it.
Every block between grant and admission is the LeaseTable's (kvtransfer/lease.py: leases,
revocations, quarantine, early releases; clock injected); its calls return the blocks to free.

Settings (decode_node/settings.py): where KV arrives and who may write it, the lease ttl,
thread lending while no prefill is in flight, and step pacing while prompts queue.
"""

from __future__ import annotations

import logging
import time

import msgspec
import torch
import zmq

from pdserve import tracing
from pdserve.decode_node.aimd import AimdLimit, AimdSettings
from pdserve.decode_node.request_record import DecodeRecord
from pdserve.decode_node.settings import DecodeSettings
from pdserve.decode_node.step_pacing import StepPacer
from pdserve.decode_node.thread_lending import ThreadLending
from pdserve.engine.engine_core import EngineCore, StepOutput, start_engine
from pdserve.kvtransfer.cuda_ipc import CudaIpcTensor
from pdserve.kvtransfer.lease import LeaseTable
from pdserve.kvtransfer.receiver import KvReceiver
from pdserve.kvtransfer.shared_pool import can_share_pool, shared_pool
from pdserve.kvtransfer.shm import SharedTensor
from pdserve.kvtransfer.wire import payload_mac_enabled
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import (
    Abort,
    KvDone,
    LeaseRenewed,
    ReserveReply,
    ReserveRequest,
    ShmPool,
    TokenOutput,
    WorkerStats,
)
from pdserve.runtime.worker_base import WorkerBase
from pdserve.runtime.worker_runtime import HeldRequests, PrefixCacheReport, describe_worker, engine_stats

log = logging.getLogger(__name__)


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, settings: DecodeSettings, auth: FrameAuth) -> None:
        super().__init__(settings, auth)
        self._shm: SharedTensor | CudaIpcTensor | None = None

        def shm_allocator(shape, dtype):
            self._shm = shared_pool(shape, dtype, settings.engine.device)
            return self._shm.tensor

        # under tensor parallelism every rank's pool is shared memory; on a GPU, CUDA IPC where it can
        shared = settings.shared_memory and can_share_pool(settings.engine.device)
        self.engine: EngineCore = start_engine(
            settings.engine,
            kv_allocator=shm_allocator if shared else None,
            on_layer_done=self.rt.mark_progress,  # a long step's layers: progress
        )
        info = self.engine.info  # the draft's layers may come with the target's (KvLayout.draft_fingerprint)
        self.leases = LeaseTable(info.num_layers, draft_layers=info.draft_num_layers)  # every block reserved
        self.lease_ttl_s = settings.lease_ttl_s
        self.receiver = KvReceiver(
            self.ctx,
            auth,
            settings.kv_bind,
            self.engine.kv_cache,
            self.leases,
            payload_mac=payload_mac_enabled(
                settings.kv_payload_mac, settings.kv_bind, settings.kv_advertise, encryption=auth.encryption
            ),
            rank_pools=self.engine.kv_head_shards,  # every rank's heads (one pool without TP)
            allow_in_place=shared,  # nobody can write an unshared pool in place
            draft_kv_cache=self.engine.draft_kv_cache,
        )
        self.kv_advertised = settings.kv_advertise or self.receiver.addr
        self.describe(
            describe_worker(
                info,
                "decode",
                self.rt.control_addr,
                settings.host,
                kv_addr=self.kv_advertised,
                shm_name=self._shm.name if self._shm else None,
                shm_pools=self._shm_pools(),
            )
        )
        self.handlers.update({ReserveRequest: self._on_reserve, Abort: self._on_abort})
        if info.caches_prefixes:
            self.kv_report = PrefixCacheReport(self.engine)
        self.requests: dict[str, DecodeRecord] = {}  # every request taken and not yet ended
        self.blocks_skipped = 0  # prompt blocks found held at reservation: never transferred
        self.local_prefills = 0  # requests taken whole: the prompt's uncached rest prefilled here
        busy = torch.get_num_threads()
        # no lending under TP: rank 0 alone on more threads would still wait for its ranks, on its own cores
        idle = busy if settings.engine.tensor_parallel_size > 1 else max(busy, settings.idle_threads or busy)
        self.threads = ThreadLending(busy, idle)
        self.pacer = StepPacer(settings.step_interval_ms)
        self.aimd: AimdLimit | None = None
        if settings.min_num_seqs is not None:
            limits = AimdSettings(settings.min_num_seqs, info.max_num_seqs, settings.tpot_target_ms / 1000.0)
            self.aimd = AimdLimit(limits)
            self.engine.set_max_num_seqs(self.aimd.limit)
        self._poller = zmq.Poller()  # both inboxes: control and KV
        self._poller.register(self.rt.inbox.socket, zmq.POLLIN)
        self._poller.register(self.receiver.socket, zmq.POLLIN)
        self._wait_ms = 0

    def _shm_pools(self) -> list[ShmPool]:
        """Every rank's shared pool with its KV heads, rank 0's first (empty: not shared)."""
        if self._shm is None:
            return []
        shards = self.engine.kv_head_shards
        names = [self._shm.name] + [s.shm_name for s in shards[1:]]
        if None in names:
            raise RuntimeError("a tensor-parallel rank's KV pool is not in shared memory")
        return [ShmPool(str(name), s.start, s.end) for name, s in zip(names, shards, strict=True)]

    # --- reservations -----------------------------------------------------------------------
    def _on_reserve(self, req: ReserveRequest) -> None:
        started = time.monotonic()
        outcome = self._reserve(req)
        if req.traceparent and tracing.enabled():
            tracing.record_span("decode.reserve", req.traceparent, started, attributes={"pdserve.outcome": outcome})
            if outcome == "local":  # it prefills the rest here: its decode starts now
                self.trace_start(req.request_id, req.traceparent, started)

    def _reserve(self, req: ReserveRequest) -> str:
        """Answer a reservation: "lease" (granted), "local" (prefilled here) or "refused"."""
        if req.to_worker and req.to_worker != self.worker_id:
            log.info("ignoring reservation %s meant for %s", req.request_id, req.to_worker)
            return "refused"  # queued for a previous worker on this address
        info, st = self.engine.info, self.engine.stats()
        n_blocks = -(-req.num_prompt_tokens // info.block_size)
        held = self._held_prefix(req)  # leading blocks this worker holds already: not transferred
        need = n_blocks - len(held)
        seats = st.seq_limit - st.num_seats - self.leases.num_active
        wanted = min(req.num_seqs, st.seq_limit)  # a wider group runs alone
        reason, full = "", False  # full: refused for lack of room now, worth retrying later
        if req.request_id in self.requests or self.leases.get(req.request_id) is not None:
            reason = "duplicate request id"
        elif self.draining:  # (asked before the gateway heard): another worker, or later
            reason, full = "draining", True
        elif req.num_prompt_tokens + req.max_tokens > info.max_model_len:
            reason = f"prompt + max_tokens exceeds max_model_len {info.max_model_len}"
        elif seats < wanted:
            reason, full = "no free decode seats", True
        elif not self.engine.can_reserve(need, held):
            reason, full = f"no KV blocks ({need} needed, {st.num_free_blocks} free)", True
        if reason:
            self.rt.to_gateway(
                req.gateway_id,
                ReserveReply(request_id=req.request_id, worker_id=self.worker_id, reason=reason, capacity=full),
            )
            return "refused"
        taken = self._prefill_here(req, len(held), st.num_waiting)
        if taken is not None:
            return "local" if taken else "refused"
        blocks = self.engine.reserve_blocks(need, held)
        lease = self.leases.grant(req.request_id, blocks, self.lease_ttl_s, prefix_block_ids=held)
        self.blocks_skipped += len(held)
        self.requests[req.request_id] = DecodeRecord(req.gateway_id)
        self.rt.to_gateway(
            req.gateway_id, ReserveReply(request_id=req.request_id, worker_id=self.worker_id, lease=lease)
        )
        return "lease"

    def _prefill_here(self, req: ReserveRequest, held_blocks: int, num_waiting: int) -> bool | None:
        """Conditional disaggregation: take the whole request when the gateway offers it, the
        prompt's rest beyond the blocks held here is at most its `local_prefill_max_tokens`, and
        no other prompt waits here (two would stall the decode batch twice), unless the gateway
        says `local_prefill_always`. The engine's scheduler finds the held blocks again by their
        hashes and prefills the rest in a mixed step. Returns None when it does not apply (a
        lease follows), else whether it was taken (answered either way)."""
        eng = self.engine
        rest = req.num_prompt_tokens - held_blocks * eng.info.block_size
        if (
            not req.local_prefill_max_tokens
            or req.sampling is None
            or len(req.prompt_token_ids) != req.num_prompt_tokens
            or rest > req.local_prefill_max_tokens
            or (num_waiting and not req.local_prefill_always)
        ):
            return None
        try:
            eng.add_request(req.request_id, req.prompt_token_ids, req.sampling)
        except ValueError as e:
            self.rt.to_gateway(
                req.gateway_id, ReserveReply(request_id=req.request_id, worker_id=self.worker_id, reason=str(e))
            )
            return False
        self.requests[req.request_id] = DecodeRecord(req.gateway_id)
        self.local_prefills += 1
        self.rt.to_gateway(
            req.gateway_id, ReserveReply(request_id=req.request_id, worker_id=self.worker_id, local=True)
        )
        return True

    def _held_prefix(self, req: ReserveRequest) -> list[int]:
        """Blocks of this pool holding the longest run of the prompt's leading full blocks (by
        the hashes the gateway sent), leaving at least its last block to be written."""
        usable = (req.num_prompt_tokens - 1) // self.engine.info.block_size
        return self.engine.cached_prefix(req.block_hashes[:usable])

    def _on_kv_done(self, done: KvDone) -> None:
        lease = self.leases.get(done.request_id)
        rec = self.requests.get(done.request_id)
        if lease is None or rec is None:
            return
        self.leases.release(done.request_id)  # blocks now belong to the sequence
        rec.waiting_since = time.monotonic()
        rec.prompt_logprobs = done.prompt_logprobs
        self.trace_start(done.request_id, done.traceparent, rec.waiting_since)
        try:  # the engine owns the lease's blocks from this call on, admitted or refused
            outputs = self.engine.add_prefilled(
                done.request_id,
                done.prompt_token_ids,
                done.first_token,
                done.first_logprob,
                done.sampling,
                lease.prefix_block_ids + lease.block_ids,
                fork=done.fork or None,
                # the draft's layers came too: its KV for the leased blocks (the others: cached here)
                draft_kv_blocks=len(lease.block_ids) if done.num_layers > self.leases.num_layers else 0,
                num_prefix_blocks=len(lease.prefix_block_ids),  # checked to hold this prompt
            )
        except ValueError as e:  # e.g. a prompt that does not fit: its blocks went back, report
            self._emit(done.request_id, [], None, "error", 1, error=str(e))
            return
        for i, out in enumerate(outputs):  # a group's first tokens (P's timings go with them)
            self._emit_step(out, done.timings if i == 0 and done.fork else None)

    def _on_kv_failed(self, done: KvDone, reason: str) -> None:
        """P finished the transfer but some of it never landed (frames dropped, late or
        rejected): free the lease now (P writes it no more) and end the request with an error."""
        blocks = self.leases.release_early(done.request_id, done.lease_epoch)
        if not blocks:
            return  # not this lease's epoch (a stale or replayed KvDone): nothing to end
        self.engine.release_blocks(blocks)
        self._emit(
            done.request_id,
            [],
            None,
            "error",
            1,
            error=f"KV transfer failed on the decode worker ({reason}: frames missing or rejected)",
        )

    def _on_abort(self, msg: Abort) -> None:
        """A running sequence frees its blocks in the engine; a lease's go back now when its
        writer is known gone (`lease_unused`), else after its deadline (LeaseTable.abort). One
        member of a group (`seq_index`) stops alone and reports its end."""
        if msg.seq_index is not None:
            out = self.engine.stop_member(msg.request_id, msg.seq_index)
            if out is not None:
                self._emit_step(out)
                self.rt.flush_outputs()
            return
        if not self.engine.abort(msg.request_id):
            self.engine.release_blocks(self.leases.abort(msg.request_id, writer_gone=msg.lease_unused))
        self._forget(msg.request_id, "aborted")

    def _forget(self, request_id: str, reason: str, tokens: int | None = None) -> DecodeRecord | None:
        """The one place a request's record goes (its blocks are the engine's or the lease table's)."""
        self.trace_end(request_id, "decode", reason, tokens)
        return self.requests.pop(request_id, None)

    def _report_renewals(self) -> None:
        """Leases a prefill worker renewed (it still holds their requests): tell it, through the
        request's gateway, the deadline it may now write by."""
        for request_id, lease in self.receiver.renewed:
            rec = self.requests.get(request_id)
            if rec is not None:
                self.rt.to_gateway(
                    rec.gateway_id,
                    LeaseRenewed(
                        request_id=request_id,
                        worker_id=self.worker_id,
                        lease_epoch=lease.epoch,
                        deadline=lease.deadline,
                    ),
                )
        self.receiver.renewed.clear()

    def _reclaim(self) -> None:
        now = time.time()
        for request_id in self.leases.expire(now):
            rec = self._forget(request_id, "error")
            if rec is not None:
                self.rt.to_gateway(
                    rec.gateway_id,
                    TokenOutput(
                        request_id=request_id,
                        worker_id=self.worker_id,
                        finish_reason="error",
                        error="KV transfer did not complete before the lease deadline",
                    ),
                )
        blocks = self.leases.reclaimable(now)
        if blocks:
            self.engine.release_blocks(blocks)

    # --- outputs (held, then sent one frame a gateway by rt.flush_outputs) --------------------
    def _emit_step(self, out: StepOutput, timings: dict[str, float] | None = None) -> None:
        rec = self.requests.get(out.request_id)
        waited = rec.take_wait(time.monotonic()) if rec is not None else None
        if waited is not None:
            timings = {**(timings or {}), "decode_admission_s": waited}
        self._emit(
            out.request_id,
            out.new_token_ids,
            out.logprobs,
            out.finish_reason,
            out.num_output_tokens - len(out.new_token_ids),
            timings,
            cached_tokens=out.num_cached_tokens if out.num_output_tokens == 1 else 0,  # a local prefill's
            seq_index=out.seq_index,
            done=out.request_done,
            prompt_logprobs=out.prompt_logprobs,  # a local prefill's
        )

    def _emit(
        self,
        request_id,
        tokens,
        logprobs,
        reason,
        index,
        timings=None,
        error=None,
        cached_tokens=0,
        seq_index=0,
        done=None,
        prompt_logprobs=None,
    ) -> None:
        rec = self.requests.get(request_id)
        if rec is None:
            return
        if rec.prompt_logprobs is not None:  # a group's, from its KvDone: with its first output
            prompt_logprobs, rec.prompt_logprobs = rec.prompt_logprobs, None
        self.rt.hold_output(
            rec.gateway_id,
            TokenOutput(
                request_id=request_id,
                worker_id=self.worker_id,
                index=index,
                token_ids=tokens,
                logprobs=logprobs,
                finish_reason=reason,
                error=error,
                timings=timings or {},
                cached_tokens=cached_tokens,
                seq_index=seq_index,
                prompt_logprobs=prompt_logprobs,
            ),
        )
        if done or (done is None and reason is not None):
            self._forget(request_id, reason or "done", index + len(tokens))

    def step(self) -> None:
        self.rt.mark_step()
        st = self.engine.stats()  # (one snapshot a step: the limit changes only in _adapt)
        self.threads.update(self.leases.num_active, st.num_running)
        started = time.monotonic()
        self.pacer.started(started)
        sched = self.engine.schedule()
        emitted = 0
        for out in self.engine.execute(sched):
            emitted += len(out.new_token_ids)
            self._emit_step(out)
        decodes = len(sched.decodes) + len(sched.speculative)
        if decodes and not sched.prefills:  # does stepping on the lent cores pay? (thread_lending.py)
            self.threads.observe(decodes, time.monotonic() - started, emitted)
        if self.aimd is not None and decodes:
            self._adapt(time.monotonic() - started, decodes, len(sched.preempted), st.seq_limit)
        self.rt.flush_outputs()
        self._last_progress = time.monotonic()

    def _adapt(self, step_s: float, running: int, preempted: int, seq_limit: int) -> None:
        """AIMD on the limit of running sequences; the heartbeats carry it to the gateway."""
        assert self.aimd is not None
        limit = self.aimd.observe(step_s, running, preempted)
        if limit != seq_limit:
            self.engine.set_max_num_seqs(limit)
            assert self.rt.info is not None
            self.rt.info = msgspec.structs.replace(self.rt.info, max_num_seqs=limit)

    def stats(self) -> WorkerStats:
        dropped = sum(self.rt.inbox.dropped.values()) + sum(self.receiver.dropped.values())
        st = self.engine.stats()
        return engine_stats(
            st,
            self._last_progress,
            dropped,
            extra_waiting=self.leases.num_active,
            leases_active=self.leases.num_active,
            kv_blocks_quarantined=self.leases.num_quarantined_blocks,
            lease_renewals=self.leases.num_renewals,
            kv_blocks_skipped=self.blocks_skipped,
            local_prefills=self.local_prefills,
            **st.speculation,
        )

    def describe_start(self) -> str:
        return (
            f"kv {self.receiver.addr}, advertised {self.kv_advertised}, payload mac {self.receiver.payload_mac}, "
            f"shm {self._shm.name if self._shm else None}, threads {self.threads.busy}"
            + (f", {self.threads.idle} while no prefill is in flight" if self.threads.enabled else "")
            + (
                f", steps up to {self.pacer.max_interval_s * 1000:g} ms apart while prompts queue"
                if self.pacer.enabled
                else ""
            )
        )

    def has_work(self) -> bool:
        return self.engine.has_work() or self.leases.num_active > 0 or bool(self.requests)

    def held_requests(self) -> HeldRequests:
        """Every request taken and not ended (leases, local prefills, running), and the leases."""
        return list(self.requests), [r for r in self.requests if r in self.leases]

    def run_once(self) -> None:
        if self._wait_ms:  # sleep on both inboxes: no work, or (paced) the next step is not due
            self._poller.poll(self._wait_ms)
        for msg in self.rt.drain(0):
            self.dispatch(msg)
        for done in self.receiver.poll(0):
            self._on_kv_done(done)
        for done, reason in self.receiver.failed_done:
            self._on_kv_failed(done, reason)
        self.receiver.failed_done.clear()
        if self.receiver.released:  # leases P gave back early: reusable now
            self.engine.release_blocks(self.receiver.released)
            self.receiver.released.clear()
        self._report_renewals()
        self._reclaim()
        self.rt.flush_outputs()  # what the handlers above emitted (errors, early finishes)
        self._wait_ms = self.pacer.delay_ms(self.leases.num_active) if self.engine.has_work() else 20
        if self._wait_ms == 0:
            self.step()

    def close(self) -> None:
        self.receiver.close()
        super().close()
        if self._shm is not None:
            self._shm.close()
