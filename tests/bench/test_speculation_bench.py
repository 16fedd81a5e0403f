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


def test_bench_rows_with_an_eagle_head_on_cpu_time(tiny_llama, tmp_path, capsys):
    from pdserve.modelgen.make_eagle_head import make_eagle_head

    head = make_eagle_head(tiny_llama, tmp_path / "head")
    argv = ["--model", str(tiny_llama), "--eagle", str(head), "--batches", "1", "--max-tokens", "16", "--repeats", "1"]
    assert main([*argv, "--workloads", "repetitive", "--cpu-time"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if '"workload"' in line]
    assert len(rows) == 1 and '"draft": "eagle head"' in rows[0] and '"same_output": true' in rows[0]
