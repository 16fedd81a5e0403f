"""The skeleton every worker kind shares: handler table, unknown messages, the loop, SIGTERM
(draining: heartbeats say so, held work finishes, then Deregister; or the drain times out)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import zmq

from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.channel import Inbox
from pdserve.protocol.messages import (
    Abort,
    Deregister,
    Heartbeat,
    KvLayout,
    Register,
    Welcome,
    WorkerInfo,
    WorkerStats,
    decode_to_gateway,
)
from pdserve.runtime.worker_base import DRAIN_SETTLE_S, WorkerBase
from pdserve.runtime.worker_settings import WorkerSettings

AUTH = FrameAuth(b"k" * 32)


class Echo(WorkerBase):
    role = "echo"

    def __init__(self, gateway: str = "tcp://127.0.0.1:9", busy_turns: int = 0, drain_timeout_s: float = 30.0) -> None:
        settings = WorkerSettings(gateways=[gateway], host="h", drain_timeout_s=drain_timeout_s)
        super().__init__(settings, AUTH)
        self.busy_turns = busy_turns  # turns after SIGTERM it still holds work
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

    def has_work(self) -> bool:
        return self.turns < 3 + self.busy_turns

    def run_once(self) -> None:
        self.turns += 1
        if self.turns == 3:
            os.kill(os.getpid(), signal.SIGTERM)  # the worker's own handler starts the drain
        time.sleep(0.01)


@contextlib.contextmanager
def signals_restored():
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_handlers_unknown_messages_and_sigterm():
    w = Echo()
    with signals_restored():
        w.dispatch(Abort(request_id="r1"))
        assert w.aborted == ["r1"]
        w.dispatch(WorkerStats(kv_blocks_free=0, kv_blocks_total=0, num_running=0, num_waiting=0, steps=0))
        w.dispatch(WorkerStats(kv_blocks_free=0, kv_blocks_total=0, num_running=0, num_waiting=0, steps=0))
        assert w.rt.inbox.dropped["unknown_message"] == 2 and w.aborted == ["r1"]  # counted, not handled
        assert Welcome in w.handlers  # membership is every worker's
        w.run()  # SIGTERM at the third turn; idle: leaves after DRAIN_SETTLE_S, sockets closed
        assert w.ctx.closed


def _gateway_inbox():
    ctx = zmq.Context()
    return ctx, Inbox(ctx, AUTH, "tcp://127.0.0.1:0", decoder=decode_to_gateway)


def _received(inbox: Inbox) -> list:
    msgs = []
    while (m := inbox.recv_one(200)) is not None:
        msgs.append(m)
    return msgs


def test_sigterm_drains_held_work_then_deregisters():
    ctx, inbox = _gateway_inbox()
    w = Echo(inbox.addr, busy_turns=60)  # ~0.6 s of work held after SIGTERM
    try:
        with signals_restored():
            started = time.monotonic()
            w.run()
            took = time.monotonic() - started
        msgs = _received(inbox)
        assert any(isinstance(m, Register) and m.via == inbox.addr for m in msgs)
        assert w.turns >= 63  # the held work ran to the end
        assert any(isinstance(m, Heartbeat) and m.stats.draining for m in msgs)  # gateways were told
        (left,) = [m for m in msgs if isinstance(m, Deregister)]
        assert left.worker_id == "echo-1" and left.reason == "drained"
        # (a heartbeat sent just before, on its own socket, may arrive after: gateways ignore it)
        assert took >= DRAIN_SETTLE_S
    finally:
        inbox.close()
        ctx.term()


def test_drain_timeout_hands_off_what_is_held():
    ctx, inbox = _gateway_inbox()
    w = Echo(inbox.addr, busy_turns=10**9, drain_timeout_s=0.5)
    try:
        with signals_restored():
            started = time.monotonic()
            w.run()
            assert time.monotonic() - started < 5
        (left,) = [m for m in _received(inbox) if isinstance(m, Deregister)]
        assert "timed out" in left.reason
    finally:
        inbox.close()
        ctx.term()
