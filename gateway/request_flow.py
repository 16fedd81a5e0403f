"""A disaggregated request's flow: admission -> a decode worker's lease -> prefill -> decode ->
(a worker lost: migration) -> the end, one task per request driving its `RequestRecord`.

    admit (queue turn) -> ReserveRequest -> D -> ReserveReply(lease) -> PrefillRequest -> P
    ... outputs go socket -> record -> stream without this task; it waits for the attempt's end:
    finished (released) | WorkerLost -> migrate (re-prefill prompt + tokens streamed) or fail

A prefill worker lost before the first token: retried on another pair; a decode worker lost:
with `on_decode_failure="migrate"` the prompt plus the tokens already streamed are prefilled again
on a live pair and the stream goes on (no duplicate or missing tokens), with "fail" the stream
ends with an error. A group (n > 1, best_of, beams) migrates by running again from its prompt: its
members' seeds (or the beam search) replay the same tokens, and each choice's tokens already
streamed are skipped.

Requests are handed to prefill workers as soon as they hold a lease, not held back here: a
gateway-side window of 4 steps of a prefill worker's budget cut a 1P1D burst on the bench model
to 156-421 output tok/s against 480-622 without it (two variants, A/B in the same runs).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Literal

from pdserve import tracing
from pdserve.gateway.admission import AdmissionQueue, request_priority
from pdserve.gateway.backend import BackendUnavailable
from pdserve.gateway.cluster_members import BlockMemo, ClusterMembers
from pdserve.gateway.membership import WorkerEntry
from pdserve.gateway.placement_rates import PlacementRates, kv_bytes_per_token
from pdserve.gateway.prefill_placement import PlacementInputs
from pdserve.gateway.prefix_fetch_plan import FetchPlan, FetchRates, can_export_to, effective_held_tokens, plan_fetch
from pdserve.gateway.reconcile import RequestForgotten
from pdserve.gateway.request_record import RequestRecord, RequestTable, WorkerLost
from pdserve.gateway.router import Router
from pdserve.protocol.messages import (
    Abort,
    KvDestination,
    PrefillRequest,
    PrefixSource,
    ReserveReply,
    ReserveRequest,
    TokenOutput,
)
from pdserve.protocol.sampling import SamplingParams

# the one default of each (GatewayOptions, ClusterBackend)
KV_TRANSPORTS = ("auto", "shm", "cuda-ipc", "zmq")
DEFAULT_KV_TRANSPORT = "auto"
DEFAULT_ON_DECODE_FAILURE = "migrate"

log = logging.getLogger(__name__)

Pair = tuple[WorkerEntry | None, WorkerEntry, ReserveReply]  # (P or None: D prefills it itself, D, its reply)


class DisaggregatedFlow:
    def __init__(
        self,
        members: ClusterMembers,
        requests: RequestTable,
        router: Router,
        queue: AdmissionQueue[Pair],
        *,
        kv_transport: str,
        reserve_timeout_s: float,
        on_decode_failure: str,
        max_attempts: int,
        on_release: Callable[[], None],
        on_reconciled: Callable[[str], None] = lambda outcome: None,
    ) -> None:
        self.members, self.requests, self.router, self.queue = members, requests, router, queue
        self.table, self.plane = members.table, members.plane
        self.kv_transport = kv_transport
        self.reserve_timeout_s = reserve_timeout_s
        self.on_decode_failure = on_decode_failure
        self.max_attempts = max_attempts
        self._on_release = on_release  # a decode seat is free
        self._on_reconciled = on_reconciled  # (outcome) a forgotten request moved or failed
        self.rates = PlacementRates()  # measured for the placement cost model (router.py)

    async def run(self, rec: RequestRecord) -> None:
        """The request from its admission to its end; its stream always ends (the reader sees
        an error raised here as the stream's end)."""
        try:
            while True:
                rec.begin_attempt()
                try:
                    await self._attempt(rec)
                    return
                except WorkerLost as lost:
                    if not await self._may_migrate(rec, lost):
                        return
                    rec.state = "migrating"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # BackendUnavailable before any token, or a failure: the reader's
            rec.stream.end(e)
        finally:
            rec.stream.end()

    async def _attempt(self, rec: RequestRecord) -> None:
        rec.state = "queued"
        self.requests.add(rec)
        prompt, sampling = rec.attempt_request()
        resumed = rec.attempt > 1
        try:
            queued_at = time.monotonic()
            p, d, reply = await self.queue.admit(
                len(prompt),
                lambda: self._start_pair(rec, prompt),
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
            rec.state = "prefilling"
            if p is not None:  # else the decode worker prefills the short rest itself
                assert reply.lease is not None
                dest = KvDestination(
                    worker_id=d.worker_id,
                    kv_addr=d.info.kv_addr or "",
                    shm_name=d.info.shm_name,
                    transport=self._transport_for(p, d),
                    lease=reply.lease,
                    layout=d.info.kv_layout,
                    shm_pools=d.info.shm_pools,
                )
                self.plane.send(
                    p.worker_id,
                    PrefillRequest(
                        request_id=rec.worker_request_id,
                        gateway_id=self.members.gateway_id,
                        prompt_token_ids=prompt,
                        sampling=sampling,
                        dest=dest,
                        arrival_time=time.time(),
                        traceparent=tracing.current_traceparent.get(),
                        prefix_source=self._prefix_source(p, prompt, sampling),
                    ),
                )
            assert rec.outcome is not None
            await rec.outcome  # the outputs arrive meanwhile (ClusterBackend._dispatch -> rec.accept)
        except WorkerLost as lost:
            if rec.state == "prefilling" and rec.prefill is not None and rec.decode is not None:
                if rec.prefill.worker_id in lost.worker_ids and not isinstance(lost, RequestForgotten):
                    # its lease may never be written or released (a live prefill worker gets the Abort)
                    self.members.orphan_lease(
                        rec.prefill.worker_id, rec.worker_request_id, rec.decode.worker_id, rec.lease_deadline
                    )
            raise
        finally:
            self._release(rec)

    def _release(self, rec: RequestRecord) -> None:
        """The attempt's end, the one place its workers are let go: a worker that ended it has
        released its side; ended here (client gone, stop string, lost), both are told."""
        self.requests.remove(rec)
        p, d = rec.prefill, rec.decode
        if d is not None:
            if not rec.ended_by:
                if p is not None:
                    self.plane.send(p.worker_id, Abort(request_id=rec.worker_request_id, reason="stream closed"))
                self.plane.send(d.worker_id, Abort(request_id=rec.worker_request_id, reason="stream closed"))
            elif p is not None and rec.ended_by == p.worker_id:  # ended at its first token: free D's lease
                self.plane.send(d.worker_id, Abort(request_id=rec.worker_request_id, reason="finished at prefill"))
            rec.let_go()
            self._on_release()

    async def _may_migrate(self, rec: RequestRecord, lost: WorkerLost) -> bool:
        """Whether the request goes on after `lost` (else its stream ends with an error)."""
        generated = sum(rec.delivered.values()) if rec.sampling.is_group else len(rec.generated)
        retry = rec.attempt < self.max_attempts and (not generated or self.on_decode_failure == "migrate")
        log.warning(
            "request %s lost worker(s) %s after %d tokens; %s",
            rec.request_id,
            lost.worker_ids,
            generated,
            "retrying on a live pair" if retry else "failing it",
        )
        error = None if retry else f"worker {', '.join(lost.worker_ids)} {lost.reason}"
        if retry and (not self.table.live("prefill") or not self.table.live("decode")):
            await asyncio.sleep(min(2.0, self.table.dead_after_s))  # a restart may be on its way
            if not self.table.live("prefill") or not self.table.live("decode"):
                error = "no live prefill/decode pair to continue the request"
        if isinstance(lost, RequestForgotten):
            self._on_reconciled("failed" if error is not None else "migrated")
        if error is not None:
            index = 0 if rec.sampling.is_group else len(rec.generated)
            rec.stream.push(TokenOutput(request_id=rec.request_id, index=index, finish_reason="error", error=error))
            return False
        return True

    # --- one admission turn -----------------------------------------------------------------
    async def _start_pair(self, rec: RequestRecord, prompt: list[int]) -> Pair | None:
        """A decode worker's lease and a prefill worker for it (None when the decode worker took
        the whole request: `ReserveReply.local`); None when no decode worker has room now."""
        if not self.table.live("prefill"):
            raise BackendUnavailable("no live prefill worker", retry_after_s=2.0)
        memo: BlockMemo = {}
        got = await self._reserve(rec, prompt, memo)
        if got is None:
            return None
        d, reply = got
        if reply.local:  # the decode worker prefills the rest itself
            rec.hold(None, d)
            rec.local_since = time.monotonic()
            return None, d, reply
        assert reply.lease is not None  # _reserve returns granted leases or local takes only
        # KV is only exchanged between workers running the same model, dtype and shapes.
        prefills = [p for p in self.table.live("prefill") if p.info.model_fingerprint == d.info.model_fingerprint]
        if not prefills:
            self.plane.send(
                d.worker_id, Abort(request_id=rec.worker_request_id, reason="no prefill worker", lease_unused=True)
            )
            raise BackendUnavailable(f"no live prefill worker for {d.info.model_fingerprint}", retry_after_s=2.0)
        p = self._pick_prefill(prefills, prompt, memo)[0]
        rec.lease_deadline = reply.lease.deadline
        rec.hold(p, d)
        rec.state = "prefilling"  # (counted at the prefill worker from now on)
        return p, d, reply

    def _pick_prefill(
        self, prefills: list[WorkerEntry], prompt: list[int], memo: BlockMemo
    ) -> tuple[WorkerEntry, dict[str, int]]:
        """The router's prefill worker for this prompt, and the tokens of it each candidate
        counts as holding: kv-aware, a prefix a peer could send it counts too, less the fetch's
        cost (gateway/prefix_fetch_plan.py)."""
        held = {w.worker_id: self.members.held_blocks(w, prompt, memo) * w.info.kv_layout.block_size for w in prefills}
        if self.router.policy == "kv-aware":
            for w in prefills:
                plan = self._prefix_fetch(w, held[w.worker_id] // w.info.kv_layout.block_size, prompt, memo)
                held[w.worker_id] = effective_held_tokens(held[w.worker_id], plan)
        return self.router.pick_prefill("prefill", prefills, held, self.queued_prefill_tokens(), len(prompt)), held

    def _prefix_fetch(self, w: WorkerEntry, held_blocks: int, prompt: list[int], memo: BlockMemo) -> FetchPlan | None:
        """Whether `w`, holding `held_blocks` of the prompt's leading blocks, should fetch more of
        them from a live peer than compute them (None: compute)."""
        if w.info.export_addr is None:  # (a worker without prefix sharing fetches nothing either)
            return None
        now = time.monotonic()
        peers = {
            e.worker_id: self.members.held_blocks(e, prompt, memo)
            for e in self.table.workers.values()
            if can_export_to(e.info, w.info) and self.table.is_live(e, now)
        }
        lay = w.info.kv_layout
        rates = FetchRates(
            lay.block_size,
            kv_bytes_per_token(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype),
            self.rates.prefill.rate,
            self.rates.fetch.rate,
        )
        return plan_fetch(held_blocks, peers, (len(prompt) - 1) // lay.block_size, rates)

    def _prefix_source(self, p: WorkerEntry, prompt: list[int], sampling: SamplingParams) -> PrefixSource | None:
        """The peer `p` fetches the prompt's leading blocks from before computing the rest, if any."""
        if sampling.prompt_logprobs is not None:  # (scored whole: nothing comes from a cache)
            return None
        memo: BlockMemo = {}
        plan = self._prefix_fetch(p, self.members.held_blocks(p, prompt, memo), prompt, memo)
        peer = self.table.get(plan.peer_id) if plan is not None else None
        if plan is None or peer is None or peer.info.export_addr is None:
            return None
        log.debug("prefix fetch for %s on %s: %s", prompt[:4], p.worker_id, plan)
        return PrefixSource(
            worker_id=peer.worker_id,
            export_addr=peer.info.export_addr,
            num_blocks=plan.num_blocks,
            timeout_s=plan.timeout_s,
        )

    def queued_prefill_tokens(self) -> dict[str, int]:
        """Prompt tokens handed to each prefill worker that has not sent their first token yet."""
        queued: dict[str, int] = {}
        for r in self.requests:
            if r.state == "prefilling" and r.prefill is not None:
                queued[r.prefill.worker_id] = queued.get(r.prefill.worker_id, 0) + r.attempt_prompt_tokens
        return queued

    def observe_first_output(self, rec: RequestRecord, out: TokenOutput) -> None:
        """Feed the placement rates from an attempt's first output (its timings)."""
        now = time.monotonic()
        tokens = rec.attempt_prompt_tokens - out.cached_tokens
        if rec.prefill is not None:
            self.rates.observe_remote(rec.prefill.worker_id, tokens, out.timings, now)
        elif rec.decode is not None and rec.local_since > 0:
            self.rates.observe_local(rec.decode.worker_id, tokens, rec.local_since, now)

    def _placement_inputs(
        self, d: WorkerEntry, held_tokens: int, prompt: list[int], memo: BlockMemo
    ) -> PlacementInputs | None:
        """What the cost model needs to place this prompt if `d` takes it (None: no prefill
        worker could take it, so no choice)."""
        prefills = [p for p in self.table.live("prefill") if p.info.model_fingerprint == d.info.model_fingerprint]
        if not prefills:
            return None
        queued = self.queued_prefill_tokens()
        p, held = self._pick_prefill(prefills, prompt, memo)
        # what this gateway knows before d's next heartbeat: its requests decoding there, and
        # its local prefills there without a first token (prompts waiting for d's engine)
        decoding = local_waiting = 0
        for r in self.requests:
            if r.decode is d:
                decoding += r.state == "decoding"
                local_waiting += r.state == "prefilling" and r.prefill is None
        lay = d.info.kv_layout
        return PlacementInputs(
            local_tokens=len(prompt) - held_tokens,
            remote_tokens=len(prompt) - held[p.worker_id],
            transfer_tokens=len(prompt) - held_tokens,
            decode_running=max(d.stats.num_running, decoding),
            decode_waiting=max(d.stats.num_waiting - d.stats.leases_active, local_waiting),
            pool_queued_tokens=queued.get(p.worker_id, 0),
            prefill_rate=self.rates.prefill.rate,
            local_rate=self.rates.local_rate(time.monotonic()),
            link_rate=self.rates.link.rate,
            kv_bytes_per_token=kv_bytes_per_token(lay.num_layers, lay.num_kv_heads, lay.head_dim, lay.dtype),
        )

    async def _reserve(
        self, rec: RequestRecord, prompt: list[int], memo: BlockMemo
    ) -> tuple[WorkerEntry, ReserveReply] | None:
        """A lease from the first live decode worker that grants one; None when every one is full
        now (the request waits in the queue), BackendUnavailable when none could ever take it."""
        decodes = self.table.live("decode")
        if not decodes:
            raise BackendUnavailable("no live decode worker", retry_after_s=2.0)
        reasons, full = [], False
        sampling = rec.attempt_request()[1]
        held = {d.worker_id: self.members.held_blocks(d, prompt, memo) for d in decodes}
        for d in self.router.decode_order(decodes, held, len(prompt)):
            # ask it to prefill the rest itself when that costs less (router.py, prefill placement);
            # a scored prompt (prompt logprobs) is computed whole: what d caches of it saves nothing
            held_tokens = 0 if sampling.prompt_logprobs is not None else held[d.worker_id] * d.info.kv_layout.block_size
            x = self._placement_inputs(d, held_tokens, prompt, memo) if self.router.weighs_placement else None
            local = self.router.local_prefill_offer(held_tokens, len(prompt), x)
            if x is not None and log.isEnabledFor(logging.DEBUG):
                log.debug(
                    "placement of %s on %s: %s -> %s", rec.request_id, d.worker_id, x, "local" if local else "remote"
                )
            fut: asyncio.Future[ReserveReply] = asyncio.get_running_loop().create_future()
            rec.reservation = fut
            d.reserving += 1
            self.plane.send(
                d.worker_id,
                ReserveRequest(
                    request_id=rec.worker_request_id,
                    gateway_id=self.members.gateway_id,
                    to_worker=d.worker_id,
                    num_prompt_tokens=len(prompt),
                    max_tokens=sampling.max_tokens,
                    block_hashes=self.members.block_hashes(prompt, d.info, memo),
                    local_prefill_max_tokens=local,
                    local_prefill_always=self.router.placement == "local",
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
                self.plane.send(
                    d.worker_id,
                    Abort(request_id=rec.worker_request_id, reason="reservation timed out", lease_unused=True),
                )
                # D may still take it (a late lease, or a local prefill whose tokens follow) before
                # the abort lands: nothing done under this id may answer a later reservation
                self.requests.abandon_worker_id(rec)
                continue
            finally:
                d.reserving -= 1
                rec.reservation = None
            if reply.lease is not None or reply.local:
                return d, reply
            full = full or reply.capacity
            reasons.append(f"{d.worker_id}: {reply.reason}")
        if full:
            return None
        raise BackendUnavailable(
            "no decode worker can take the request (" + "; ".join(reasons) + ")", retry_after_s=1.0
        )

    def _transport_for(self, p: WorkerEntry, d: WorkerEntry) -> Literal["zmq", "shm", "cuda-ipc"]:
        """shm: D's CPU pool, same host; cuda-ipc: D's GPU pool, P's KV on that same GPU; else zmq."""
        shared = d.info.shm_name is not None and p.info.host == d.info.host
        kind: Literal["shm", "cuda-ipc"] = "cuda-ipc" if d.info.kv_device else "shm"
        if d.info.kv_device:  # a GPU pool: shared by CUDA IPC with a writer on the same GPU
            can = shared and p.info.kv_device == d.info.kv_device
        else:
            can = shared and not p.info.kv_device
        if self.kv_transport in ("shm", "cuda-ipc") and not can:
            log.warning(
                "%s transport asked for but %s cannot write %s's KV pool in place: zmq",
                self.kv_transport,
                p.worker_id,
                d.worker_id,
            )
        return kind if can and self.kv_transport in ("auto", kind) else "zmq"
