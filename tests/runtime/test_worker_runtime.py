"""Heartbeats flow from their own thread while the engine loop is busy, and carry the loop's
silence as a growing `last_step_age_s` (how the gateway tells a long step from a stuck loop).
A step's outputs leave as one frame per gateway."""

from __future__ import annotations

import time

import pytest
import zmq

from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.channel import Inbox
from pdserve.protocol.messages import (
    Heartbeat,
    KvLayout,
    TokenOutput,
    TokenOutputBatch,
    Welcome,
    WorkerInfo,
    WorkerStats,
)
from pdserve.runtime.worker_runtime import WorkerRuntime


def _info() -> WorkerInfo:
    return WorkerInfo(
        worker_id="decode-test-1",
        role="decode",
        control_addr="ipc://unused",
        host="127.0.0.1",
        pid=1,
        model_fingerprint="fp",
        kv_layout=KvLayout(1, 8, 16, 1, 8, "float32"),
        max_model_len=64,
    )


def _heartbeats(inbox: Inbox, seconds: float) -> list[Heartbeat]:
    got, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        msg = inbox.recv_one(50)
        if isinstance(msg, Heartbeat):
            got.append(msg)
    return got


@pytest.fixture
def runtime_and_gateway(tmp_path):
    """A worker runtime and the gateway inbox it reports to; closed after the test."""
    ctx = zmq.Context()
    auth = FrameAuth(b"k" * 32)
    gateway = Inbox(ctx, auth, f"ipc://{tmp_path}/gw.sock")
    rt = WorkerRuntime(ctx, auth, f"ipc://{tmp_path}/w.sock", [gateway.addr])
    rt.info = _info()
    try:
        yield rt, gateway
    finally:
        rt.close()
        gateway.close()
        ctx.term()


def test_heartbeats_continue_while_the_loop_blocks(runtime_and_gateway):
    rt, gateway = runtime_and_gateway
    busy = WorkerStats(kv_blocks_free=8, kv_blocks_total=8, num_running=1, last_step_age_s=0.01)
    rt.tick(lambda: busy)  # the loop publishes once, then "blocks" in a long step
    beats = _heartbeats(gateway, 1.8)
    assert len(beats) >= 2, "no heartbeats while the engine loop was blocked"
    ages = [b.stats.last_step_age_s for b in beats]
    assert ages == sorted(ages) and ages[-1] > 1.0  # the silence is reported, growing

    idle = WorkerStats(kv_blocks_free=8, kv_blocks_total=8)  # no work: age stays 0
    time.sleep(0.1)
    rt.tick(lambda: idle)
    beats = _heartbeats(gateway, 1.2)
    assert beats and beats[-1].stats.last_step_age_s == 0.0


def test_a_long_step_that_finishes_layers_is_not_reported_stuck(runtime_and_gateway):
    """A real-size prefill of thousands of tokens takes minutes on a few cores; each of its layers
    that finishes is progress (ModelRunner.on_layer_done -> mark_progress): the age counts from
    the latest, while a step that finishes none ages on."""
    rt, gateway = runtime_and_gateway
    busy = WorkerStats(kv_blocks_free=8, kv_blocks_total=8, num_running=1, last_step_age_s=0.01)
    rt.tick(lambda: busy)
    rt.mark_step()  # the loop begins a long step
    deadline = time.monotonic() + 1.6
    while time.monotonic() < deadline:  # a layer finishes every 0.1 s
        time.sleep(0.1)
        rt.mark_progress()
        # the loop ticks on meanwhile (a prefill worker's lanes run the step), publishing its own
        # age since the last finished step
        rt.tick(lambda: WorkerStats(kv_blocks_free=8, kv_blocks_total=8, num_running=1, last_step_age_s=5.0))
    assert rt.step_age() < 0.3
    time.sleep(0.8)  # then no layer finishes: the age grows from the last one
    assert 0.7 < rt.step_age() < 1.3
    beats = _heartbeats(gateway, 0.6)
    assert beats and beats[-1].stats.last_step_age_s > 0.7


def test_held_outputs_go_out_as_one_frame_per_gateway(runtime_and_gateway):
    """A step's outputs for one gateway travel as one TokenOutputBatch (one HMAC, one send); a
    lone output stays a plain TokenOutput; nothing is sent before the flush."""
    rt, gateway = runtime_and_gateway
    rt.handle_welcome(Welcome(gateway_id="g1", inbox_addr=gateway.addr))
    outs = [TokenOutput(request_id=f"r{i}", index=3, token_ids=[i]) for i in range(3)]
    for out in outs:
        rt.hold_output("g1", out)
    assert gateway.recv_one(100) is None  # held until the flush
    rt.flush_outputs()
    assert gateway.recv_one(2000) == TokenOutputBatch(outputs=outs)
    rt.flush_outputs()  # nothing held: nothing sent
    rt.hold_output("g1", outs[0])
    rt.flush_outputs()
    assert gateway.recv_one(2000) == outs[0]
    assert gateway.recv_one(100) is None


def test_prefix_cache_digests_are_numbered_full_first_then_deltas():
    """What KV-aware routing at the gateway is fed: the whole set first (and every few seconds),
    changes in between, each digest numbered so that a lost one shows as a gap."""
    from pdserve.engine.block_pool import BlockPool
    from pdserve.protocol.block_hashes import short_id
    from pdserve.runtime.worker_runtime import Heartbeater, PrefixCacheReport

    ctx = zmq.Context()
    hb = Heartbeater(ctx, FrameAuth(b"k" * 32), ["ipc://unused"])
    pool = BlockPool(8)

    class Engine:  # an engine's prefix-cache calls (EngineCore) over a bare pool
        def prefix_cache_changes(self):
            events, pool.events = pool.events or [], []
            return events

        def prefix_cache_hashes(self):
            return pool.hashes()

    report = PrefixCacheReport(Engine())  # type: ignore[arg-type]
    a, b = pool.allocate(1), pool.allocate(1)
    pool.register(a[0], b"ha" * 8)
    hb.publish(_info(), WorkerStats(), report())  # first report: the whole set
    first = hb._current()
    assert first is not None and first.kv is not None
    assert first.kv.full and first.kv.seq == 1 and first.kv.stored == [short_id(b"ha" * 8)]
    pool.register(b[0], b"hb" * 8)
    pool.free(a)
    pool.allocate(7)  # evicts a's cached block
    hb.publish(_info(), WorkerStats(), report())
    second = hb._current()
    assert second is not None and second.kv is not None and not second.kv.full and second.kv.seq == 2
    assert second.kv.stored == [short_id(b"hb" * 8)] and second.kv.removed == [short_id(b"ha" * 8)]
    third = hb._current()  # nothing changed: an empty digest, still numbered
    assert third is not None and third.kv is not None and third.kv.seq == 3 and not third.kv.stored
    hb.close()
    ctx.term()
