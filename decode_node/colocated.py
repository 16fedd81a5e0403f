"""Colocated worker: one process runs both phases in mixed batches (decode tokens first, then
prefill chunks under the token budget). The baseline that shows what disaggregation buys, and
a deployment choice for small setups. Speaks the same protocol as the pools (GenerateRequest).
"""

from __future__ import annotations

import logging
import time

from pdserve.decode_node.request_record import DecodeRecord
from pdserve.decode_node.settings import ColocatedSettings
from pdserve.engine.engine_core import EngineCore, StepOutput, start_engine, wire_finish_reason
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import Abort, GenerateRequest, TokenOutput, WorkerStats
from pdserve.runtime.worker_base import WorkerBase
from pdserve.runtime.worker_runtime import HeldRequests, PrefixCacheReport, describe_worker, engine_stats

log = logging.getLogger(__name__)


class ColocatedWorker(WorkerBase):
    role = "colocated"

    def __init__(self, settings: ColocatedSettings, auth: FrameAuth) -> None:
        super().__init__(settings, auth)
        # (a long step's layers count as progress)
        self.engine: EngineCore = start_engine(settings.engine, on_layer_done=self.rt.mark_progress)
        self.describe(describe_worker(self.engine.info, "colocated", self.rt.control_addr, settings.host))
        if self.engine.info.caches_prefixes:
            self.kv_report = PrefixCacheReport(self.engine)
        self.handlers.update({GenerateRequest: self._on_generate, Abort: self._on_abort})
        self.requests: dict[str, DecodeRecord] = {}  # every request taken and not yet ended

    def _on_generate(self, req: GenerateRequest) -> None:
        try:
            self.engine.add_request(req.request_id, req.prompt_token_ids, req.sampling)
        except ValueError as e:
            self.rt.to_gateway(
                req.gateway_id,
                TokenOutput(request_id=req.request_id, worker_id=self.worker_id, finish_reason="error", error=str(e)),
            )
            return
        arrived = time.monotonic()
        self.requests[req.request_id] = DecodeRecord(req.gateway_id, waiting_since=arrived)
        self.trace_start(req.request_id, req.traceparent, arrived)

    def _on_abort(self, msg: Abort) -> None:
        if msg.seq_index is not None:  # one member of a group: the others run on
            out = self.engine.stop_member(msg.request_id, msg.seq_index)
            if out is not None:
                self._emit(out)
                self.rt.flush_outputs()
            return
        self.engine.abort(msg.request_id)
        self._forget(msg.request_id, "aborted")

    def _forget(self, request_id: str, reason: str, tokens: int | None = None) -> None:
        """The one place a request's record goes (its blocks are its engine sequence's)."""
        self.trace_end(request_id, "colocated.generate", reason, tokens)
        self.requests.pop(request_id, None)

    def step(self) -> None:
        self.rt.mark_step()
        sched = self.engine.schedule()
        now = time.monotonic()
        first_seen = {}  # request id -> seconds it queued before its prompt's first chunk
        for c in sched.prefills:
            rec = self.requests.get(c.seq.request_id)
            waited = rec.take_wait(now) if rec is not None else None
            if waited is not None:
                first_seen[c.seq.request_id] = waited
        for out in self.engine.execute(sched):
            timings = {}
            if out.num_output_tokens == 1 and out.request_id in first_seen:
                timings = {"prefill_queue_s": first_seen[out.request_id], "prefill_compute_s": time.monotonic() - now}
            self._emit(out, timings)
        self.rt.flush_outputs()  # the step's outputs, one frame a gateway
        self._last_progress = time.monotonic()

    def _emit(self, out: StepOutput, timings: dict[str, float] | None = None) -> None:
        rec = self.requests.get(out.request_id)
        if rec is None:
            return
        self.rt.hold_output(
            rec.gateway_id,
            TokenOutput(
                request_id=out.request_id,
                worker_id=self.worker_id,
                index=out.num_output_tokens - len(out.new_token_ids),
                token_ids=out.new_token_ids,
                logprobs=out.logprobs,
                finish_reason=wire_finish_reason(out.finish_reason),
                timings=timings or {},
                cached_tokens=out.num_cached_tokens if out.num_output_tokens == 1 else 0,
                seq_index=out.seq_index,
                prompt_logprobs=out.prompt_logprobs,
            ),
        )
        if out.request_done:
            self._forget(out.request_id, out.finish_reason or "done", out.num_output_tokens)

    def stats(self) -> WorkerStats:
        st = self.engine.stats()
        return engine_stats(st, self._last_progress, sum(self.rt.inbox.dropped.values()), **st.speculation)

    def has_work(self) -> bool:
        return self.engine.has_work() or bool(self.requests)

    def held_requests(self) -> HeldRequests:
        return list(self.requests), []

    def run_once(self) -> None:
        for msg in self.rt.drain(0 if self.engine.has_work() else 20):
            self.dispatch(msg)
        if self.engine.has_work():
            self.step()
