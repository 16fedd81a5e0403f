"""`python -m pdserve.bench.prefill_attention`: FLOPs counted as the causal formula says, every
way's output checked against the torch reference before it is timed, every case and way reported."""

from __future__ import annotations

import json

import pytest
import torch

from pdserve.bench import prefill_attention as bench
from pdserve.kernels import cpu_native


def test_whole_prompt_flops_are_the_causal_formula():
    t, hq, d = 512, 9, 64
    assert bench.attention_flops([t], [t], hq, d) == 2 * 2 * t * (t + 1) // 2 * d * hq


def test_chunk_flops_count_every_key_each_query_sees():
    q_lens, ctx_lens, hq, d = [5, 3], [12, 3], 2, 8
    keys = sum(c - q + i + 1 for q, c in zip(q_lens, ctx_lens) for i in range(q))
    assert bench.attention_flops(q_lens, ctx_lens, hq, d) == 4 * d * hq * keys


def test_report_has_every_case_and_way(capsys):
    assert bench.main(["--shapes", "smollm2", "--lengths", "24", "--repeat", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["matmul_gflops"] > 0
    cases = {r["case"] for r in res["rows"]}
    assert cases == {"single 24", "ragged 4x<=24", f"chunk {bench.CHUNK} after {bench.CHUNK_PAST}"}
    ways = {"sdpa", "sdpa+gather", "torch-ref", "dispatch"}
    if cpu_native.prefill_available(cpu_native.FLASH_SOURCE):
        ways |= {"flash-c", "tiled-c"}
    for case in cases:
        rows = [r for r in res["rows"] if r["case"] == case]
        assert {r["way"] for r in rows} == ways
        for r in rows:
            assert r["ms"] > 0 and r["gflops"] > 0 and r["max_abs_err"] < 1e-4
            assert r["matmul_share"] == pytest.approx(r["gflops"] / res["matmul_gflops"])


def test_a_wrong_way_is_refused_before_it_is_timed(monkeypatch):
    case = bench.make_case("single 20", [20], [20], 8, 4, 64)
    real = bench.runners
    monkeypatch.setattr(bench, "runners", lambda c: {**real(c), "broken": lambda: torch.zeros_like(c.query)})
    with pytest.raises(AssertionError, match="broken differs"):
        bench.bench_case(case, 8, 64, repeat=1)


def test_block_tables_are_not_runs():
    """The KV is read through the block table, never as one contiguous stretch."""
    case = bench.make_case("ragged", [40, 64], [40, 64], 8, 4, 64)
    assert case.meta.kv_run_start_cpu is not None and all(r == -1 for r in case.meta.kv_run_start_cpu)


def test_bf16_rows_have_the_flash_kernel_not_the_fp32_only_one(capsys):
    argv = ["--shapes", "bench", "--lengths", "20", "--no-chunked", "--repeat", "1", "--dtype", "bfloat16", "--json"]
    assert bench.main(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ways = {r["way"] for r in res["rows"]}
    assert res["dtype"] == "bfloat16" and "tiled-c" not in ways
    assert ("flash-c" in ways) == cpu_native.prefill_available(cpu_native.FLASH_SOURCE)
