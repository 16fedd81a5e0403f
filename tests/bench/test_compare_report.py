"""`pdserve bench-compare` end to end on the tiny model: runs, skips a missing peer, writes the report."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.compare import main

pytestmark = pytest.mark.slow


def test_compare_writes_report_and_skips_missing_peers(tiny_llama, tmp_path):
    out = tmp_path / "cmp"
    rc = main(
        [
            "--model",
            str(tiny_llama),
            "--out",
            str(out),
            "--servers",
            "pdserve-colocated,vllm-cpu",
            "--rates",
            "16",
            "--sweep-prompts",
            "4",
            "--burst-repeats",
            "2",
            "--vllm-python",
            str(tmp_path / "no-such-python"),
        ]
    )
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert "no vLLM CPU venv" in results["vllm-cpu"]["skipped"]
    ours = results["pdserve-colocated"]
    assert ours["burst"]["completed"] == 32 and ours["burst"]["failed"] == 0
    assert ours["burst"]["x_flop_bound"] > 0 and ours["sweep"][0]["request_rate"] == 16.0
    runs = ours["burst"]["runs"]  # every burst kept; the reported one is the median (upper of two)
    assert len(runs) == 2 and ours["burst"]["output_throughput"] == max(r["output_throughput"] for r in runs)
    # the server's own processes (gateway + worker) took CPU, measured from /proc beside each run
    assert ours["burst"]["server_cpu_s_per_request"] > 0 and 0 < ours["sweep"][0]["server_cpu_utilization"] <= 1.05
    assert ours["burst"]["server_cpu_s_per_request_by_role"]["colocated"] > 0  # its worker did the model's work
    report = (out / "README.md").read_text()
    assert (
        "| pdserve-colocated |" in report and "core-s per request" in report and (out / "slo_attainment.png").is_file()
    )


def test_compare_runs_the_conversations_workload(tiny_llama, tmp_path):
    out = tmp_path / "cmp"
    rc = main(
        [
            "--model",
            str(tiny_llama),
            "--out",
            str(out),
            "--servers",
            "pdserve-1P1D",
            "--workloads",
            "conversations",
            "--conv-rates",
            "4",
            "--conv-count",
            "2",
            "--conv-system-len",
            "60",
        ]
    )
    assert rc == 0
    ours = json.loads((out / "results.json").read_text())["pdserve-1P1D"]
    (run,) = ours["conversations"]
    assert run["failed"] == 0 and run["completed"] >= 10 and run["conversations"] == 2
    assert run["turns"]["2"]["mean_cached_tokens"] >= 48  # the shared system prompt, at least
    assert ours["conversation_capacity"] == 4.0 or run["goodput_attainment"] < 0.9
    assert "| pdserve-1P1D | " in (out / "README.md").read_text().split("## Conversations")[1]


def test_the_report_names_every_option_the_run_changed():
    import argparse

    from pdserve.bench.compare import _command_line

    ap = argparse.ArgumentParser()
    for flag, default in (("--model", None), ("--out", "o"), ("--rates", "1,2"), ("--gguf", None)):
        ap.add_argument(flag, default=default)
    ap.add_argument("--burst-repeats", type=int, default=3)
    ap.add_argument("--reuse", action="store_true")
    args = ap.parse_args(["--model", "/m", "--rates", "0.25,0.5", "--burst-repeats", "1", "--reuse", "--gguf", "g"])
    assert _command_line(ap, args) == "pdserve bench-compare --model MODEL --rates 0.25,0.5 --burst-repeats 1 --reuse"
