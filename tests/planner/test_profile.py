"""Profiling a real engine (the tiny model, one thread) gives costs that grow with the work and
predict the steps they were fitted on; `pdserve plan --model` makes and keeps them."""

from __future__ import annotations

import pytest

from pdserve.planner.cli import main as plan_main
from pdserve.planner.costs import load
from pdserve.planner.profile import profile

pytestmark = pytest.mark.slow


def test_profile_fits_costs_that_grow_with_the_work(tiny_llama, tmp_path, capsys):
    costs = profile(str(tiny_llama), threads=[1], repeats=1, progress=lambda _: None)
    c = costs.by_threads[1]
    assert c.prefill_s(512, 512 * 256) > c.prefill_s(64, 64 * 32) > 0
    assert c.decode_s(32, 32 * 512) > c.decode_s(1, 128) > 0
    assert costs.kv_bytes_per_token > 0 and costs.transfer_gbps > 0 and costs.block_size == 16
    path = tmp_path / "costs.json"
    args = ["--model", str(tiny_llama), "--costs", str(path), "--rate", "1", "--num-prompts", "50"]
    args += ["--input-len", "128", "--output-len", "16", "--max-prefill", "2", "--max-decode", "2"]
    assert plan_main(args) == 0  # profiled (all cores), saved, then planned
    assert load(str(path)).by_threads and "cheapest meeting" in capsys.readouterr().out
