"""`python -m pdserve.bench.draft_kv` runs end to end on a tiny model: one row per prompt length,
the draft's layers adding exactly their share of the bytes (the draft here: the model's first
layer, so L + 1 layers of the same shape go instead of L)."""

from __future__ import annotations

import json

from pdserve.bench.draft_kv import main


def test_bench_rows(tiny_llama, capsys):
    assert main(["--model", str(tiny_llama), "--cut-draft", "1", "--prompt-lens", "20", "40", "--repeats", "1"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["prompt_tokens"] for r in rows] == [20, 40]
    for r in rows:
        assert r["kv_bytes_with_draft"] * 2 == r["kv_bytes_target"] * 3  # tiny: 2 layers; the draft: 1 of them
        assert r["first_cpu_True"] > 0 and r["prefill_draft"] > 0
