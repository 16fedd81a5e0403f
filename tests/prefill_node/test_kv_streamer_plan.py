"""The prefill worker's transfer plan (prefill_node/kv_streamer.py `KvStreamer.prepare`) covers
every block of every prompt, whatever the chunking: random prompt lengths arriving over time
under a small token budget (chunks that end mid-block, a prompt's last token left for a step of
its own, prompts finishing inside a step with others), each request's blocks planned in chunk
order, the block holding its last token in its last job, and one job marked last, in the step
that completes its prompt. A block missing from the plan is a block D never receives (or, when
an earlier chunk sent it, one whose later positions D holds stale)."""

from __future__ import annotations

import random
import time

import pytest

from pdserve.engine.llm_engine import PREFILLED
from pdserve.prefill_node.kv_streamer import KvStreamer
from pdserve.prefill_node.request_record import PrefillRecord
from pdserve.protocol.messages import KvDestination, KvLayout, Lease, PrefillRequest
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.engine.test_engine_vs_hf import make_engine

SP = SamplingParams(max_tokens=2, temperature=0.0)
BS = 4


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_prompt_block_is_planned_and_the_last_job_is_marked(tiny_llama, seed):
    engine = make_engine(tiny_llama, block_size=BS, num_blocks=256, max_num_batched_tokens=7)
    rng = random.Random(seed)
    lengths = [rng.randint(1, 30) for _ in range(24)] + [8, 9, 13, 1]  # 9 = 7 + 2, 8 = 7 + 1
    prompts = random_prompts(engine.model_config.vocab_size, lengths, seed=seed)
    layout = KvLayout(engine.model_config.num_layers, 10_000, BS, 2, 16, "float32")
    streamer = KvStreamer(engine.kv_cache, BS)
    records: dict[str, PrefillRecord] = {}
    planned: dict[str, list[tuple[list[int], bool]]] = {}
    done_step: dict[str, int] = {}
    next_block = 0
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_work():
        for _ in range(rng.randint(0, 3) if engine.has_work() else 1):  # arrivals between steps
            if pending:
                i, prompt = pending.pop(0)
                rid = f"r{i}"
                n_blocks = -(-len(prompt) // BS)
                lease = Lease(
                    epoch=1, block_ids=list(range(next_block, next_block + n_blocks)), deadline=time.time() + 60
                )
                next_block += n_blocks
                dest = KvDestination(
                    worker_id="d", kv_addr="ipc://unused", shm_name=None, transport="zmq", lease=lease, layout=layout
                )
                req = PrefillRequest(request_id=rid, gateway_id="g", prompt_token_ids=prompt, sampling=SP, dest=dest)
                records[rid] = PrefillRecord(req, sender=None, received=time.monotonic())  # type: ignore[arg-type]
                engine.add_request(rid, prompt, SP, prefill_only=True)
        sched = engine.schedule()
        transfers = streamer.prepare(sched, records)
        for job in transfers.jobs:
            planned.setdefault(job.request_id, []).append((job.dst_blocks, job.last))
        for out in engine.execute(sched):
            assert out.finish_reason == PREFILLED
            done_step[out.request_id] = step
        for job in transfers.jobs:
            if job.last:
                assert done_step.get(job.request_id) == step, f"{job.request_id}: last job before its prompt completed"
        step += 1
    assert set(done_step) == set(records)
    for rid, rec in records.items():
        jobs = planned.get(rid, [])
        lease_blocks = rec.dest.lease.block_ids
        covered = [b for blocks, _ in jobs for b in blocks]
        assert set(covered) == set(lease_blocks), (
            f"{rid} ({len(rec.req.prompt_token_ids)} tokens): blocks planned {jobs}"
        )
        assert covered == sorted(covered), f"{rid}: blocks out of chunk order: {jobs}"
        assert [last for _, last in jobs].count(True) == 1 and jobs[-1][1], f"{rid}: {jobs}"
        assert lease_blocks[-1] in jobs[-1][0], f"{rid}: the last token's block is not in its last job"
