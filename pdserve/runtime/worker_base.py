"""The skeleton every worker process shares: start-up, membership, a message-type -> handler
table, the loop, SIGTERM, and shutdown. Prefill, decode and colocated workers fill in their
handlers and one turn of their loop (`run_once`); everything else is here once.

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

import zmq

from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import Welcome, WorkerInfo, WorkerStats
from pdserve.runtime.worker_runtime import PrefixCacheReport, WorkerRuntime
from pdserve.runtime.worker_settings import WorkerSettings

log = logging.getLogger(__name__)

Handler = Callable[[Any], None]


class WorkerBase:
    role = "worker"

    def __init__(self, settings: WorkerSettings, auth: FrameAuth) -> None:
        self.settings = settings
        self.auth = auth
        self.ctx = zmq.Context()
        self.rt = WorkerRuntime(self.ctx, auth, settings.control_bind, settings.gateways)
        self.handlers: dict[type, Handler] = {Welcome: self.rt.handle_welcome}
        self._stop = False
        self._last_progress = time.monotonic()  # when an engine step last completed
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

    def run_once(self) -> None:
        """One turn of the loop: take messages (blocking briefly when idle), step the engine."""
        raise NotImplementedError

    def stop(self) -> None:
        self._stop = True

    def run(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.stop())
        log.info("%s worker %s on %s: %s", self.role, self.worker_id, self.rt.control_addr, self.describe_start())
        try:
            while not self._stop:
                self.run_once()
                self.rt.tick(self.stats, self.kv_report)
        finally:
            self.close()

    def describe_start(self) -> str:
        """The start-up log line's role-specific part."""
        return ""

    def close(self) -> None:
        self.rt.close()
        self.ctx.term()
