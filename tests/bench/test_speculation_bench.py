"""`python -m pdserve.bench.speculation` runs end to end on a tiny model: one row per workload and
batch, both runs emitting the same tokens."""

from __future__ import annotations

from pdserve.bench.speculation import main


def test_bench_rows(tiny_llama, capsys):
    assert main(["--model", str(tiny_llama), "--batches", "1", "2", "--max-tokens", "16", "--repeats", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if '"workload"' in line]
    assert len(rows) == 4 and all('"same_output": true' in r for r in rows)
    assert '"read_gbps_before"' in lines[-1]
