"""`python -m pdserve.bench.gateway_cpu` end to end on a small burst: a real gateway over the
model-free stub workers (both modes) serves every token asked for, streamed and not, and the
script prints a CPU figure per output token for each."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_the_gateway_cpu_bench_measures_a_burst(mode):
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.bench.gateway_cpu", "--mode", mode, "--requests", "8", "--max-tokens", "16"]
        + ["--repeats", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    figures = dict(re.findall(r"^(streamed|non-streamed): gateway CPU ([\d.]+) us per output token", r.stdout, re.M))
    assert set(figures) == {"streamed", "non-streamed"}, r.stdout
    assert all(float(v) >= 0 for v in figures.values())
    assert r.stdout.count("128 tokens") == 2  # each burst got every token (8 x 16): checked by the script too
