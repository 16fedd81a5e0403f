"""A queue too short to fill every free prefill lane with full steps is split over them, so a
lone prompt's chunks run on all lanes at once; under load the step budget is untouched."""

from __future__ import annotations

import pytest

from pdserve.prefill_node.lane_split import MIN_SPLIT_TOKENS, step_budget_for_lanes
from pdserve.protocol.sampling import SamplingParams
from tests.prefill_node.workers import complete_until_gone, gate_layers, prefill_worker


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
    worker = prefill_worker(tiny_llama, block_size=16, num_blocks=128, budget=512, max_model_len=1024, idle_lanes=1)
    try:
        gate = gate_layers(worker)
        worker.engine.add_request(
            "r", [5 + i % 200 for i in range(600)], SamplingParams(max_tokens=2), prefill_only=True
        )
        assert worker.launch()
        jobs = list(worker.lanes._jobs)
        assert [upto for job in jobs for _, upto in job.fp.computed_upto] == [304, 600]  # not 512 + 88
        gate.set()
        complete_until_gone(worker, "r", 30)
        assert "r" not in worker.engine.seqs
        worker.engine.pool.check_integrity()
    finally:
        worker.close()
