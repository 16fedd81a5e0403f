"""The compiled Triton RMSNorm (kernels/triton_norms.py) against the torch formula on a GPU: fp32
within the sum order's rounding, bf16 within one bf16 step with the residual sum bit-equal, and
the layer ops dispatching CUDA rows to it. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import layer_ops
from pdserve.kernels.layer_ops import rms_norm_torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 2**-6)])
@pytest.mark.parametrize("rows, n", [(1, 4096), (37, 576), (8, 100), (64, 2048)])
def test_triton_norms_equal_the_torch_formula(dtype, tol, rows, n):
    from pdserve.kernels import triton_norms

    gen = torch.Generator("cuda").manual_seed(rows * n)
    x = torch.randn(rows, n, device="cuda", generator=gen).to(dtype)
    d = torch.randn(rows, n, device="cuda", generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(dtype)
    got = triton_norms.rms_norm(x, w, 1e-5)
    want = rms_norm_torch(x, w, 1e-5)
    assert got.dtype == want.dtype and (got.float() - want.float()).abs().max().item() <= tol * 4
    total, normed = triton_norms.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(total, x + d)
    assert (normed.float() - rms_norm_torch(x + d, w, 1e-5).float()).abs().max().item() <= tol * 4


def test_layer_ops_send_cuda_rows_to_triton(monkeypatch):
    from pdserve.kernels import triton_norms

    calls = []
    monkeypatch.setattr(triton_norms, "rms_norm", lambda *a: calls.append("norm") or rms_norm_torch(*a))
    x = torch.randn(4, 64, device="cuda")
    layer_ops.rms_norm(x, torch.ones(64, device="cuda"), 1e-6)
    layer_ops.rms_norm(x.t().contiguous().t(), torch.ones(64, device="cuda"), 1e-6)  # a strided last dim: torch
    assert calls == ["norm"]
