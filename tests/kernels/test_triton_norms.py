"""The Triton RMSNorm (kernels/triton_norms.py) against the torch formula (HF's), under the
interpreter on the CPU: fp32 within float rounding of the sum's order (the fused residual add's
sum bit-equal to torch's `x + delta`), bf16 within one bf16 step (the interpreter does not round
to bf16 as a GPU does; tests/gpu checks the compiled kernel's bf16 bits). TRITON_INTERPRET=1 must be set
before triton is first imported, so the kernel runs in a subprocess (this file, as a script).
The compiled kernel is tested on a GPU (tests/gpu/test_triton_norms_on_cuda.py)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SHAPES = [(3, 64), (1, 100), (5, 576)]  # 100: not a power of two (masked tail)


def errors(dtype_name: str) -> dict:
    """Max |triton - torch| of each output, over SHAPES (runs in the interpreter)."""
    import torch

    from pdserve.kernels import triton_norms
    from pdserve.kernels.layer_ops import rms_norm_torch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    worst = {"norm": 0.0, "add_sum": 0.0, "add_norm": 0.0}
    for rows, n in SHAPES:
        x = torch.randn(rows, n, generator=gen).to(dtype)
        d = torch.randn(rows, n, generator=gen).to(dtype)
        w = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
        got = triton_norms.rms_norm(x, w, 1e-6)
        worst["norm"] = max(worst["norm"], (got.float() - rms_norm_torch(x, w, 1e-6).float()).abs().max().item())
        total, normed = triton_norms.add_rms_norm(x, d, w, 1e-6)
        want_total = x + d
        worst["add_sum"] = max(worst["add_sum"], (total.float() - want_total.float()).abs().max().item())
        want = rms_norm_torch(want_total, w, 1e-6)
        worst["add_norm"] = max(worst["add_norm"], (normed.float() - want.float()).abs().max().item())
    return worst


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 0.0625)])
def test_triton_rms_norm_equals_the_torch_formula(dtype, tol):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_triton_norms", dtype],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    worst = json.loads(out.stdout.strip().splitlines()[-1])
    if dtype == "float32":
        assert worst["add_sum"] == 0.0  # the residual sum is rounded exactly as torch's
    assert max(worst.values()) <= tol, worst


if __name__ == "__main__":
    print(json.dumps(errors(sys.argv[1])))
