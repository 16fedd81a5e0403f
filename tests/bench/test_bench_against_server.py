"""A short `pdserve bench` run against a real pdserve on loopback."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.cli import bench_main
from tests.e2e.cluster import running_server

pytestmark = pytest.mark.slow


def test_bench_run_and_sweep(tiny_llama, tmp_path):
    with running_server(tiny_llama) as base:
        rc = bench_main(
            [
                "--base-url",
                base,
                "--tokenizer",
                str(tiny_llama),
                "--num-prompts",
                "6",
                "--random-input-len",
                "40",
                "--random-output-len",
                "8",
                "--random-range-ratio",
                "0.5",
                "--ignore-eos",
                "--goodput",
                "ttft:5000",
                "tpot:1000",
                "--save-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "one.json",
                "--disable-tqdm",
                "--warmup-requests",
                "2",
            ]
        )
        assert rc == 0
        res = json.loads((tmp_path / "one.json").read_text())
        assert res["completed"] == 6 and res["failed"] == 0
        assert res["total_output_tokens"] >= 6 * 4  # lengths drawn in [4, 12], ignore_eos
        for key in (
            "request_throughput",
            "output_throughput",
            "mean_ttft_ms",
            "median_tpot_ms",
            "p99_itl_ms",
            "p99_e2el_ms",
            "request_goodput",
        ):
            assert key in res, key
        assert res["ttft_breakdown_mean"]["kv_bytes"] > 0  # the server's TTFT breakdown came through
        rc = bench_main(
            [
                "--base-url",
                base,
                "--tokenizer",
                str(tiny_llama),
                "--num-prompts",
                "4",
                "--random-input-len",
                "30",
                "--random-output-len",
                "4",
                "--sweep-rates",
                "2,8",
                "--goodput",
                "ttft:5000",
                "--result-dir",
                str(tmp_path),
                "--label",
                "pdserve-1P1D",
                "--disable-tqdm",
            ]
        )
        assert rc == 0
        sweep = json.loads((tmp_path / "sweep-pdserve-1P1D.json").read_text())
        assert [r["request_rate"] for r in sweep["runs"]] == [2.0, 8.0] and sweep["capacity_req_s"] == 8.0
        assert (tmp_path / "slo_attainment.png").is_file()


def test_conversations_report_per_turn_reuse(tiny_llama, tmp_path):
    """`--dataset-name conversations` against 1P1D: every turn after the first finds the shared
    system prompt and its own history cached, and the table is keyed by turn."""
    with running_server(tiny_llama) as base:
        rc = bench_main(
            [
                "--base-url",
                base,
                "--tokenizer",
                str(tiny_llama),
                "--dataset-name",
                "conversations",
                "--num-prompts",
                "3",
                "--conv-turns",
                "3-3",
                "--conv-system-len",
                "100",
                "--conv-user-len",
                "10",
                "--conv-think-time",
                "0.3",
                "--random-output-len",
                "6",
                "--ignore-eos",
                "--save-result",
                "--result-dir",
                str(tmp_path),
                "--result-filename",
                "conv.json",
                "--disable-tqdm",
            ]
        )
        assert rc == 0
    res = json.loads((tmp_path / "conv.json").read_text())
    assert res["completed"] == 9 and res["failed"] == 0 and set(res["turns"]) == {"1", "2", "3"}
    turns = res["turns"]
    assert all(turns[t]["completed"] == 3 for t in turns)
    # the 100-token system prompt (and in ChatML some more) is cached from the second turn on
    assert (
        turns["2"]["mean_cached_tokens"] >= 96 and turns["3"]["mean_cached_tokens"] > turns["2"]["mean_cached_tokens"]
    )
    assert turns["3"]["mean_prompt_tokens"] > turns["2"]["mean_prompt_tokens"] > turns["1"]["mean_prompt_tokens"]
