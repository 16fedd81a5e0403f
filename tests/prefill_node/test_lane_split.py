"""A queue too short to fill every free prefill lane with full steps is split over them, so a
lone prompt's chunks run on all lanes at once; under load the step budget is untouched."""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.prefill_node.lane_split import MIN_SPLIT_TOKENS, step_budget_for_lanes
from pdserve.prefill_node.settings import PrefillSettings
from pdserve.prefill_node.worker import PrefillWorker
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.sampling import SamplingParams


@pytest.mark.parametrize(
    "queued,free,want",
    [
        (600, 2, 304),  # an even share, whole 16-token blocks
        (1024, 2, 512),  # fills both lanes: the full budget
        (5000, 2, 512),
        (600, 1, 512),  # one free lane: nothing to spread over
        (150, 2, MIN_SPLIT_TOKENS),  # not below the smallest chunk worth a lane
        (40, 2, MIN_SPLIT_TOKENS),
        (900, 3, 304),
    ],
)
def test_step_budget_for_lanes(queued, free, want):
    assert step_budget_for_lanes(queued, free, 512, 16) == want


def test_a_lone_prompt_goes_out_as_one_chunk_a_free_lane(tiny_llama):
    config = EngineConfig(
        model=str(tiny_llama),
        dtype="float32",
        cache=CacheConfig(block_size=16, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=1024),
    )
    settings = PrefillSettings(engine=config, gateways=["tcp://127.0.0.1:9"], host="test", lanes=1, idle_lanes=1)
    worker = PrefillWorker(settings, FrameAuth(b"k" * 32))
    try:
        gate, real_run_layers = threading.Event(), worker.engine.runner.run_layers

        def gated(fp, count=None):
            assert gate.wait(10)
            real_run_layers(fp, count)

        worker.engine.runner.run_layers = gated
        worker.engine.add_request(
            "r", [5 + i % 200 for i in range(600)], SamplingParams(max_tokens=2), prefill_only=True
        )
        assert worker.launch()
        jobs = list(worker.lanes._jobs)
        assert [upto for job in jobs for _, upto in job.fp.computed_upto] == [304, 600]  # not 512 + 88
        gate.set()
        deadline = time.monotonic() + 30
        while "r" in worker.engine.seqs and time.monotonic() < deadline:
            for job in worker.lanes.collect():
                worker.complete(job)
            time.sleep(0.01)
        assert "r" not in worker.engine.seqs
        worker.engine.pool.check_integrity()
    finally:
        worker.close()
