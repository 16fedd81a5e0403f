"""`python -m pdserve.bench.constrained_decode` runs its two batches to the end and prints the ratio."""

from __future__ import annotations

import re

from pdserve.bench.constrained_decode import main


def test_constrained_decode_bench_prints_both_batches_and_the_ratio(tiny_llama, capsys):
    assert main(["--model", str(tiny_llama), "--batch", "4", "--prompt-len", "8", "--steps", "6", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "none constrained" in out and "2 of 4 constrained" in out
    (ratio,) = re.findall(r"constrained / none: ([0-9.]+)", out)
    assert float(ratio) > 0
