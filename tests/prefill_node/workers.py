"""A PrefillWorker in this process (no gateway behind its address), its lanes held at the first
layer until the test lets them go, and its finished steps handed back as its loop would."""

from __future__ import annotations

import threading
import time

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.prefill_node.settings import PrefillSettings
from pdserve.prefill_node.worker import PrefillWorker
from pdserve.protocol.auth import FrameAuth


def prefill_worker(
    model, block_size: int, num_blocks: int, budget: int, max_model_len: int, **settings: int
) -> PrefillWorker:
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_model_len=max_model_len),
    )
    return PrefillWorker(
        PrefillSettings(engine=config, gateways=["tcp://127.0.0.1:9"], host="test", **settings), FrameAuth(b"k" * 32)
    )


def gate_layers(worker: PrefillWorker) -> threading.Event:
    """Every lane waits inside its next layer until the returned event is set."""
    gate, real_run_layers = threading.Event(), worker.engine.runner.run_layers

    def gated(fp, count=None):
        assert gate.wait(10)
        real_run_layers(fp, count)

    worker.engine.runner.run_layers = gated  # type: ignore[method-assign]
    return gate


def complete_until_gone(worker: PrefillWorker, request_id: str, timeout_s: float = 30.0) -> None:
    """Hand the lanes' finished steps back to the worker until `request_id` has left its engine."""
    deadline = time.monotonic() + timeout_s
    while request_id in worker.engine.seqs and time.monotonic() < deadline:
        for job in worker.lanes.collect():
            worker.complete(job)
        time.sleep(0.01)
