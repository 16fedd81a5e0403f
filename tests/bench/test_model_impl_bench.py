"""`python -m pdserve.bench.model_impl` prints one row per step with both paths' tok/s."""

from __future__ import annotations

import re

from pdserve.bench.model_impl import main


def test_prints_native_and_transformers_rows(tiny_llama, capsys):
    argv = ["--model", str(tiny_llama), "--batches", "1,2", "--context", "8", "--prompt-len", "16"]
    assert main([*argv, "--decode-steps", "2", "--repeats", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if re.match(r"\| (decode|prefill)", line)]
    assert [r.split(" | ")[0] for r in rows] == ["| decode batch 1", "| decode batch 2", "| prefill 16"]
    for row in rows:
        native, transformers, ratio = row.strip("| ").split(" | ")[1:]
        assert float(native) > 0 and float(transformers) > 0 and ratio.endswith("x")
