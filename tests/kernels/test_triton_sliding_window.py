"""The Triton kernels' sliding window and soft-capping under the interpreter (CPU), against the
float64 reference of test_sliding_window_attention.py: decodes (one program and split over
several) and prefill chunks crossing the window. As in test_triton_kernels.py, TRITON_INTERPRET=1
must be set before triton is imported, so the cases run in a subprocess that reports errors."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# name -> (window, softcap, decode splits)
CASES = {
    "window": (32, None, None),
    "window_small": (5, None, None),
    "softcap": (None, 2.0, None),
    "window_softcap": (16, 2.0, None),
    "window_split_decode": (32, None, 3),
    "none": (None, None, None),
}


def _errors(window: int | None, softcap: float | None, splits: int | None) -> tuple[float, float]:
    """(max error vs the reference, max change from plain attention: the option took effect)."""
    from pdserve.kernels import triton_attention
    from tests.kernels.test_sliding_window_attention import NUM_DECODE, SEQS, reference
    from tests.kernels.test_torch_attention import make_case

    case = make_case(SEQS, NUM_DECODE, 4, 2, 16, 16, seed=11)
    out = triton_attention.paged_attention(
        case.query, case.key, case.value, case.kv_layer, case.meta, case.scale,
        decode_splits=splits, window=window, softcap=softcap,
    )  # fmt: skip
    plain = reference(case, None, None)
    return (out.double() - reference(case, window, softcap)).abs().max().item(), (
        out.double() - plain
    ).abs().max().item()


@pytest.fixture(scope="module")
def report() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), PDSERVE_ATTENTION="")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_triton_sliding_window"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_triton_window_and_softcap_match_the_reference(report, name):
    error, change = report[name]
    assert error < 1e-4, report
    assert (change > 1e-2) == (name != "none"), report


if __name__ == "__main__":
    print(json.dumps({name: _errors(*spec) for name, spec in CASES.items()}))
