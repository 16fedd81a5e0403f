"""A colocated request's flow: wait in the colocated queue for a free seat on a colocated worker
C (the router's pick), `GenerateRequest -> C`, its outputs socket -> record -> stream, the end.
A lost C ends the stream with an error (nothing to migrate to: C held the whole request)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from pdserve import tracing
from pdserve.gateway.admission import AdmissionQueue, request_priority
from pdserve.gateway.backend import BackendUnavailable
from pdserve.gateway.cluster_members import BlockMemo, ClusterMembers
from pdserve.gateway.membership import WorkerEntry
from pdserve.gateway.reconcile import RequestForgotten
from pdserve.gateway.request_record import RequestRecord, RequestTable, WorkerLost
from pdserve.gateway.router import Router
from pdserve.protocol.messages import Abort, GenerateRequest, TokenOutput


class ColocatedFlow:
    def __init__(
        self,
        members: ClusterMembers,
        requests: RequestTable,
        router: Router,
        queue: AdmissionQueue[WorkerEntry],
        on_release: Callable[[], None],
        on_reconciled: Callable[[str], None] = lambda outcome: None,
    ) -> None:
        self.members, self.requests, self.router, self.queue = members, requests, router, queue
        self.table, self.plane = members.table, members.plane
        self._on_release = on_release  # a colocated seat is free
        self._on_reconciled = on_reconciled  # (outcome) a forgotten request failed

    def free_seats(self) -> int:
        return sum(max(0, c.info.max_num_seqs - c.inflight) for c in self.table.live("colocated"))

    async def _seat(self, rec: RequestRecord) -> WorkerEntry | None:
        """The colocated worker with a free seat and the least expected work before this prompt's
        first token (or as the router's policy says: gateway/router.py), taken at once; or None."""
        live = self.table.live("colocated")
        if not live:
            raise BackendUnavailable("no live colocated worker", retry_after_s=2.0)
        free = [c for c in live if c.info.max_num_seqs <= 0 or c.inflight < c.info.max_num_seqs]
        if not free:
            return None
        memo: BlockMemo = {}
        prompt = rec.prompt
        held = {w.worker_id: self.members.held_blocks(w, prompt, memo) * w.info.kv_layout.block_size for w in free}
        c = self.router.pick_prefill("colocated", free, held, {}, len(prompt))
        rec.hold(None, c)
        return c

    async def run(self, rec: RequestRecord) -> None:
        rec.begin_attempt()
        self.requests.add(rec)
        try:
            queued_at = time.monotonic()
            c = await self.queue.admit(len(rec.prompt), lambda: self._seat(rec), priority=request_priority.get())
            tracing.record_span(
                "gateway.queue",
                tracing.current_traceparent.get(),
                queued_at,
                attributes={"pdserve.colocated_worker": c.worker_id},
            )
            rec.state = "decoding"
            self.plane.send(
                c.worker_id,
                GenerateRequest(
                    request_id=rec.worker_request_id,
                    gateway_id=self.members.gateway_id,
                    prompt_token_ids=rec.prompt,
                    sampling=rec.sampling,
                    arrival_time=time.time(),
                    traceparent=tracing.current_traceparent.get(),
                ),
            )
            assert rec.outcome is not None
            try:
                await rec.outcome
            except WorkerLost as lost:
                error = f"worker {', '.join(lost.worker_ids)} {lost.reason}"
                rec.stream.push(TokenOutput(request_id=rec.request_id, finish_reason="error", error=error))
                if isinstance(lost, RequestForgotten):
                    self._on_reconciled("failed")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # BackendUnavailable before any token, or a failure: the reader's
            rec.stream.end(e)
        finally:
            rec.stream.end()
            self.requests.remove(rec)
            worker = rec.decode
            if worker is not None:
                if not rec.ended_by:
                    self.plane.send(worker.worker_id, Abort(request_id=rec.worker_request_id, reason="client gone"))
                rec.let_go()
                self._on_release()
