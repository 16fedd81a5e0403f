"""Prefill lanes: steps run a layer at a time on several threads, chunks of one prompt pipelined.

The lanes must compute exactly what one thread running each step to the end computes: the same
first tokens and the same KV, bit for bit, including for a prompt whose chunks are in flight on
two lanes at once.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from pdserve.engine.llm_engine import PREFILLED
from pdserve.prefill_node.lanes import PrefillLanes
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.engine.test_engine_vs_hf import make_engine

SP = SamplingParams(max_tokens=4, temperature=0.0)
BUDGET = dict(block_size=4, num_blocks=96, max_num_batched_tokens=16)
LENGTHS = [41, 7, 23, 16]  # 41 tokens: three 16-token steps, the later two launched in flight


def run_sequential(engine, prompts):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SP, prefill_only=True)
    first, tables = {}, {}
    while engine.has_work():
        sched = engine.schedule()
        for c in sched.chunks:
            tables[c.seq.request_id] = list(c.seq.block_table)
        for out in engine.execute(sched):
            first[out.request_id] = out.new_token_ids
            tables[out.request_id] = kv_rows(engine, tables[out.request_id], len(out.seq.prompt_token_ids))
    return first, tables


def run_in_lanes(engine, prompts, lanes):
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SP, prefill_only=True)
    first, tables, jobs = {}, {}, []
    deadline = time.monotonic() + 60
    while engine.has_work() and time.monotonic() < deadline:
        while lanes.in_flight() < lanes.capacity:
            sched = engine.scheduler.schedule(lanes.busy_sequences())
            if sched.is_empty:
                break
            for c in sched.chunks:
                tables[c.seq.request_id] = list(c.seq.block_table)
            jobs.append(lanes.submit(sched, engine.launch(sched)))
        for job in lanes.collect():
            assert job.error is None
            for out in engine.finish_step(job.fp, job.logits):
                assert out.finish_reason == PREFILLED
                first[out.request_id] = out.new_token_ids
                tables[out.request_id] = kv_rows(engine, tables[out.request_id], len(out.seq.prompt_token_ids))
        time.sleep(0.001)
    return first, tables, jobs


def kv_rows(engine, table, n):
    """The prompt's KV as it is when the request finishes (its blocks are free for others then)."""
    return engine.kv_cache[:, :, table].flatten(2, 3)[:, :, :n].clone()  # [L, 2, n, H, D]


def test_lanes_compute_what_one_thread_computes(tiny_llama):
    reference, lanes_engine = make_engine(tiny_llama, **BUDGET), make_engine(tiny_llama, **BUDGET)
    prompts = random_prompts(reference.model_config.vocab_size, LENGTHS, seed=4)
    want_first, want_kv = run_sequential(reference, prompts)

    runner, real_run_layers = lanes_engine.runner, lanes_engine.runner.run_layers

    def slow_layers(fp, count=None):
        time.sleep(0.002)  # a layer outlasts the loop's next schedule, even on a loaded machine
        real_run_layers(fp, count)

    runner.run_layers = slow_layers
    lanes = PrefillLanes(runner, lanes=1, idle_lanes=1)
    try:
        got_first, got_kv, jobs = run_in_lanes(lanes_engine, prompts, lanes)
    finally:
        lanes.close()
    assert got_first == want_first and len(got_first) == len(prompts)
    # a later chunk of a prompt ran while its earlier chunk was in flight, a layer behind it
    assert any(job.after for job in jobs)
    for rid, want in want_kv.items():
        assert torch.equal(want, got_kv[rid]), rid


def test_idle_lane_runs_at_idle_priority(tiny_llama):
    engine = make_engine(tiny_llama, **BUDGET)
    lanes = PrefillLanes(engine.runner, lanes=1, idle_lanes=1)
    try:
        deadline = time.monotonic() + 10
        while lanes.idle_priority is None and time.monotonic() < deadline:
            time.sleep(0.01)
        idle = next(t for t in threading.enumerate() if t.name == "prefill-idle-lane0")
        if lanes.idle_priority == "SCHED_IDLE":
            assert os.sched_getscheduler(idle.native_id) == os.SCHED_IDLE
        else:
            assert os.getpriority(os.PRIO_PROCESS, idle.native_id) == 19
        normal = next(t for t in threading.enumerate() if t.name == "prefill-lane0")
        assert os.sched_getscheduler(normal.native_id) == os.SCHED_OTHER
    finally:
        lanes.close()
    assert not any(t.name.startswith("prefill-") and t.is_alive() for t in threading.enumerate())


def test_lane_failure_is_handed_back(tiny_llama, monkeypatch):
    engine = make_engine(tiny_llama, **BUDGET)
    lanes = PrefillLanes(engine.runner, lanes=1)
    try:

        def broken(fp, count=None):
            raise RuntimeError("layer exploded")

        monkeypatch.setattr(engine.runner, "run_layers", broken)
        engine.add_request("r", [5, 6, 7], SP, prefill_only=True)
        sched = engine.scheduler.schedule()
        lanes.submit(sched, engine.launch(sched))
        deadline, done = time.monotonic() + 10, []
        while not done and time.monotonic() < deadline:
            done = lanes.collect()
            time.sleep(0.01)
        assert len(done) == 1 and "layer exploded" in str(done[0].error)
    finally:
        lanes.close()


@pytest.mark.parametrize("lanes, idle", [(0, 1), (1, -1)])
def test_lane_counts_are_checked(tiny_llama, lanes, idle):
    engine = make_engine(tiny_llama, **BUDGET)
    with pytest.raises(ValueError):
        PrefillLanes(engine.runner, lanes=lanes, idle_lanes=idle)
