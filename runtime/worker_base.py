"""The skeleton every worker process shares: start-up, membership, a message-type -> handler
table, the loop, draining on SIGTERM, and shutdown. Prefill, decode and colocated workers fill in
their handlers, one turn of their loop (`run_once`) and what counts as work held (`has_work`);
everything else is here once.

Draining (SIGTERM; a second SIGTERM or SIGINT stops at once): heartbeats say `draining`, so
gateways route the worker nothing new; what it holds, and what was on its way before the
gateways heard, finishes. Once it has held nothing for DRAIN_SETTLE_S it sends `Deregister` and
exits; at `drain_timeout_s` it deregisters with work still held and exits, and the gateways move
those requests to live workers (as when a worker dies, without waiting out its heartbeats).

A message with no handler is dropped and counted the same way everywhere: under
"unknown_message" in the inbox's drop counter (reported in heartbeats as dropped frames),
logged at the 1st, 2nd, 4th ... occurrence.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from pdserve import tracing
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import Refused, Welcome, WorkerInfo, WorkerStats
from pdserve.runtime.health_server import HealthServer, WorkerHealth
from pdserve.runtime.worker_runtime import HEARTBEAT_INTERVAL_S, HeldRequests, PrefixCacheReport, WorkerRuntime
from pdserve.runtime.worker_settings import WorkerSettings

log = logging.getLogger(__name__)

# Draining, idle this long: every gateway has had two heartbeats saying so, and whatever one sent
# before it heard has arrived.
DRAIN_SETTLE_S = 3 * HEARTBEAT_INTERVAL_S
LIVENESS_STUCK_AFTER_S = 60.0  # /health/live fails when a pending step has not completed this long

Handler = Callable[[Any], None]


class WorkerBase:
    role = "worker"

    def __init__(self, settings: WorkerSettings, auth: FrameAuth) -> None:
        self.settings = settings
        self.auth = auth
        self.ctx = zmq.Context()
        self.rt = WorkerRuntime(self.ctx, auth, settings.control_bind, settings.gateways)
        self.handlers: dict[type, Handler] = {Welcome: self.rt.handle_welcome, Refused: self._refused}
        self.refusal: str | None = None  # why a gateway refused this worker (it then stops)
        self._stop = False
        self._drain_since: float | None = None  # when SIGTERM asked this worker to drain
        self._idle_since: float | None = None  # while draining: since when it has held nothing
        self.health: HealthServer | None = None
        self.traced: dict[str, tuple[str, float]] = {}  # traced requests: traceparent, stage start
        self._last_progress = time.monotonic()  # when an engine step last completed, or the loop was idle
        self.kv_report: PrefixCacheReport | None = None  # set by workers with a prefix cache

    def describe(self, info: WorkerInfo) -> None:
        """Set what this worker registers with (after its engine exists)."""
        self.rt.info = info

    @property
    def worker_id(self) -> str:
        assert self.rt.info is not None, "describe() the worker first"
        return self.rt.info.worker_id

    def dispatch(self, msg: object) -> None:
        handler = self.handlers.get(type(msg))
        if handler is None:
            self.rt.inbox.drop("unknown_message", f"{self.role} worker has no handler for {type(msg).__name__}")
            return
        handler(msg)

    def stats(self) -> WorkerStats:
        raise NotImplementedError

    # --- tracing (pdserve/tracing.py): a request's stage on this worker, from start to end ---
    def trace_start(self, request_id: str, traceparent: str | None, started: float) -> None:
        if traceparent and tracing.enabled():
            self.traced[request_id] = (traceparent, started)

    def trace_end(self, request_id: str, span: str, reason: str, tokens: int | None = None) -> None:
        traced = self.traced.pop(request_id, None)
        if traced is not None:
            attributes: dict = {"pdserve.finish_reason": reason}
            if tokens is not None:
                attributes["pdserve.output_tokens"] = tokens
            tracing.record_span(span, traced[0], traced[1], attributes=attributes)

    def has_work(self) -> bool:
        """Whether it holds requests not finished (draining waits for them)."""
        raise NotImplementedError

    def held_requests(self) -> HeldRequests | None:
        """The request ids it holds now, and of them those a decode worker only leased (their KV
        awaited), for its heartbeats: a gateway ends or moves a request its worker no longer
        names (gateway/reconcile.py). None: not told (the gateway then cannot tell)."""
        return None

    @property
    def draining(self) -> bool:
        return self._drain_since is not None

    def _reported_stats(self) -> WorkerStats:
        stats = self.stats()
        return msgspec.structs.replace(stats, draining=True) if self.draining else stats

    def _health(self) -> WorkerHealth:
        return WorkerHealth(self.rt.welcomed, self.draining, self.rt.step_age(), LIVENESS_STUCK_AFTER_S)

    def begin_drain(self) -> None:
        if self.draining:  # asked twice: stop now
            self.stop()
            return
        self._drain_since = time.monotonic()
        log.info("%s worker %s draining (up to %.0f s)", self.role, self.worker_id, self.settings.drain_timeout_s)

    def _drain_step(self) -> None:
        """While draining: leave once idle long enough, or at the timeout with work handed off."""
        assert self._drain_since is not None
        now = time.monotonic()
        if self.has_work():
            self._idle_since = None
            if now - self._drain_since >= self.settings.drain_timeout_s:
                log.warning("%s worker %s: drain timed out; handing off its requests", self.role, self.worker_id)
                self.rt.deregister("drain timed out: requests handed off")
                self.stop()
            return
        self._idle_since = self._idle_since or now
        if now - self._idle_since >= DRAIN_SETTLE_S or now - self._drain_since >= self.settings.drain_timeout_s:
            log.info("%s worker %s drained; leaving", self.role, self.worker_id)
            self.rt.deregister("drained")
            self.stop()

    def run_once(self) -> None:
        """One turn of the loop: take messages (blocking briefly when idle), step the engine."""
        raise NotImplementedError

    def stop(self) -> None:
        self._stop = True

    def _refused(self, msg: Refused) -> None:
        log.error("gateway %s refused this %s worker: %s", msg.gateway_id, self.role, msg.reason)
        self.refusal = msg.reason
        self.stop()

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.begin_drain())
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # (`pdserve serve` children ignore it)
            signal.signal(signal.SIGINT, lambda *_: self.stop())
        log.info("%s worker %s on %s: %s", self.role, self.worker_id, self.rt.control_addr, self.describe_start())
        if self.settings.health_bind is not None:
            self.health = HealthServer(self.settings.health_bind, self._health)
        try:
            while not self._stop:
                if not self.has_work():  # idle time is no silence: the step age counts from here
                    self._last_progress = time.monotonic()
                self.run_once()
                self.rt.tick(self._reported_stats, self.kv_report, self.held_requests)
                if self.draining:
                    self._drain_step()
        finally:
            self.close()

    def describe_start(self) -> str:
        """The start-up log line's role-specific part."""
        return ""

    def close(self) -> None:
        if self.health is not None:
            self.health.close()
        self.rt.close()
        self.ctx.term()
