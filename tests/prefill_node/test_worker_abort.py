"""An Abort that arrives while a lane computes the request's chunk waits for the lane: the
sequence's blocks are not freed (and so not handed to another request) while being written."""

from __future__ import annotations

from pdserve.protocol.sampling import SamplingParams
from tests.prefill_node.workers import complete_until_gone, gate_layers, prefill_worker


def test_abort_waits_for_the_lane_writing_the_blocks(tiny_llama):
    worker = prefill_worker(tiny_llama, block_size=4, num_blocks=32, budget=64, max_model_len=128)
    try:
        gate = gate_layers(worker)
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
        complete_until_gone(worker, "r", 10)
        assert "r" not in worker.engine.seqs and not worker._abort_after
        pool.assert_all_free()
    finally:
        worker.close()
