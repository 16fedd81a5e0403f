"""`pdserve bench-engine` end to end on a tiny model: every row's figures are there and sane, and
decode bandwidth is taken against the read ceiling (a read-only stream), not memcpy's."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.engine_throughput import main


def test_engine_bench_reports_against_the_read_ceiling(tiny_llama, capsys):
    assert (
        main(
            [
                "--model",
                str(tiny_llama),
                "--batches",
                "1,2",
                "--prompt-len",
                "16",
                "--context",
                "16",
                "--decode-steps",
                "2",
                "--json",
                "--glibc-malloc-defaults",  # the heap tuning is process-wide: not in the test process
            ]
        )
        == 0
    )
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["batch"] for r in res["rows"]] == [1, 2]
    assert res["matmul_gflops"] > 0 and res["memcpy_gbps"] > 0 and res["read_gbps"] > 0
    for r in res["rows"]:
        assert r["prefill_tokens_per_s"] > 0 and r["decode_step_ms"] > 0 and 0 < r["prefill_mfu"]
    # util = bytes read a step / step time / read GB/s. Recovered through read_gbps, the two rows'
    # bytes differ by exactly one sequence's KV (context + decode_steps // 2 tokens)
    read = [r["decode_bw_util"] * res["read_gbps"] * 1e9 * r["decode_step_ms"] / 1e3 for r in res["rows"]]
    cfg = json.loads((tiny_llama / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * head_dim * 4
    assert abs((read[1] - read[0]) - (16 + 1) * kv_per_token) < 1e-6 * read[1]


def test_engine_bench_counts_attention_and_compares_the_tiled_kernel(tiny_llama, capsys):
    """MFU+attn adds the causal attention FLOPs to the linears'; --compare-tiled-prefill times the
    same prompts on the older tiled C kernel in the same run."""
    argv = ["--model", str(tiny_llama), "--batches", "1", "--prompt-len", "32", "--context", "16", "--json"]
    argv += ["--glibc-malloc-defaults"]  # the heap tuning is process-wide: not in the test process
    assert main([*argv, "--decode-steps", "2", "--repeats", "1", "--compare-tiled-prefill"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = json.loads((tiny_llama / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    attn = 4 * cfg["num_hidden_layers"] * cfg["num_attention_heads"] * head_dim * 32 * 33 // 2 / 32  # per token
    linear = 2 * res["params_decoder_layers"]
    assert res["prefill_attention_flop_share"] == pytest.approx(attn / (attn + linear))
    (r,) = res["rows"]
    assert r["prefill_mfu_with_attention"] == pytest.approx(r["prefill_mfu"] * (attn + linear) / linear)
    assert r["prefill_tokens_per_s_tiled"] > 0
    assert r["prefill_mfu_with_attention_tiled"] == pytest.approx(
        r["prefill_mfu_with_attention"] * r["prefill_tokens_per_s_tiled"] / r["prefill_tokens_per_s"]
    )


def test_tiled_prefill_attention_puts_the_engine_on_the_tiled_kernel():
    from pdserve.bench.engine_throughput import tiled_prefill_attention
    from pdserve.kernels import attention, cpu_native

    before = attention.CPU_PREFILL_KERNELS
    with tiled_prefill_attention():
        assert attention.CPU_PREFILL_KERNELS == (cpu_native.PREFILL_SOURCE,)
    assert attention.CPU_PREFILL_KERNELS == before


def test_engine_bench_refuses_zero_decode_steps(tiny_llama):
    with pytest.raises(SystemExit) as e:
        main(["--model", str(tiny_llama), "--batches", "1", "--decode-steps", "0", "--glibc-malloc-defaults"])
    assert e.value.code == 2  # argparse's usage error, before any engine is built
