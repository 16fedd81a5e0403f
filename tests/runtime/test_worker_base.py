"""The skeleton every worker kind shares: handler table, unknown messages, the loop, SIGTERM."""

from __future__ import annotations

import os
import signal

from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import Abort, KvLayout, Welcome, WorkerInfo, WorkerStats
from pdserve.runtime.worker_base import WorkerBase
from pdserve.runtime.worker_settings import WorkerSettings


class Echo(WorkerBase):
    role = "echo"

    def __init__(self) -> None:
        super().__init__(WorkerSettings(gateways=["tcp://127.0.0.1:9"], host="h"), FrameAuth(b"k" * 32))
        self.describe(
            WorkerInfo(
                worker_id="echo-1",
                role="prefill",
                control_addr=self.rt.control_addr,
                host="h",
                pid=os.getpid(),
                model_fingerprint="m",
                kv_layout=KvLayout(1, 1, 1, 1, 1, "float32"),
            )
        )
        self.aborted: list[str] = []
        self.handlers[Abort] = lambda msg: self.aborted.append(msg.request_id)
        self.turns = 0

    def stats(self) -> WorkerStats:
        return WorkerStats(kv_blocks_free=0, kv_blocks_total=0, num_running=0, num_waiting=0, steps=self.turns)

    def run_once(self) -> None:
        self.turns += 1
        if self.turns == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the worker's own handler ends the loop


def test_handlers_unknown_messages_and_sigterm():
    w = Echo()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        w.dispatch(Abort(request_id="r1"))
        assert w.aborted == ["r1"]
        w.dispatch(WorkerStats(kv_blocks_free=0, kv_blocks_total=0, num_running=0, num_waiting=0, steps=0))
        w.dispatch(WorkerStats(kv_blocks_free=0, kv_blocks_total=0, num_running=0, num_waiting=0, steps=0))
        assert w.rt.inbox.dropped["unknown_message"] == 2 and w.aborted == ["r1"]  # counted, not handled
        assert Welcome in w.handlers  # membership is every worker's
        w.run()  # returns after SIGTERM at the third turn, sockets closed
        assert w.turns == 3 and w.ctx.closed
    finally:
        signal.signal(signal.SIGTERM, previous)
