"""An Abort that arrives while a lane computes the request's chunk waits for the lane: the
sequence's blocks are not freed (and so not handed to another request) while being written."""

from __future__ import annotations

import threading
import time

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.prefill_node.settings import PrefillSettings
from pdserve.prefill_node.worker import PrefillWorker
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.sampling import SamplingParams


def test_abort_waits_for_the_lane_writing_the_blocks(tiny_llama):
    config = EngineConfig(
        model=str(tiny_llama),
        dtype="float32",
        cache=CacheConfig(block_size=4, num_blocks=32),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_model_len=128),
    )
    worker = PrefillWorker(
        PrefillSettings(engine=config, gateways=["tcp://127.0.0.1:9"], host="test"), FrameAuth(b"k" * 32)
    )
    try:
        runner, gate = worker.engine.runner, threading.Event()
        real_run_layers = runner.run_layers

        def gated(fp, count=None):
            assert gate.wait(10)
            real_run_layers(fp, count)

        runner.run_layers = gated
        pool = worker.engine.pool
        worker.engine.add_request("r", list(range(3, 23)), SamplingParams(max_tokens=2), prefill_only=True)
        assert worker.launch()
        seq = worker.engine.seqs["r"]
        held = list(seq.block_table)
        assert held and pool.num_free == 32 - len(held)

        worker._abort("r")  # the lane is inside layer 0, writing these blocks
        assert "r" in worker._abort_after and pool.num_free == 32 - len(held)
        assert worker.engine.scheduler.schedule(worker.lanes.busy_sequences()).is_empty

        gate.set()
        deadline = time.monotonic() + 10
        while "r" in worker.engine.seqs and time.monotonic() < deadline:
            for job in worker.lanes.collect():
                worker.complete(job)
            time.sleep(0.01)
        assert "r" not in worker.engine.seqs and not worker._abort_after
        pool.assert_all_free()
    finally:
        worker.close()
