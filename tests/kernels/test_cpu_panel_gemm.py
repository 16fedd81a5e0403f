"""The C few-row GEMM (kernels/cpu_panel_gemm.c) on panel-packed weights, against float64."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import panel_gemm

pytestmark = pytest.mark.skipif(not panel_gemm.available(), reason="no C compiler: oneDNN/torch only")


@pytest.mark.parametrize("n_in,n_out", [(96, 40), (13, 8), (512, 1024), (64, 17), (1536, 512)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 17, 32])  # AVX2 tiles 6 rows, AVX-512 16
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(n_in, n_out, rows, bias):
    g = torch.Generator().manual_seed(n_in * 7 + n_out + rows)
    w = torch.randn(n_out, n_in, generator=g)
    b = torch.randn(n_out, generator=g) if bias else None
    x = torch.randn(rows, n_in + 3, generator=g)[:, :n_in]  # rows apart, as from a wider tensor
    panels = panel_gemm.pack(w)
    assert panels.shape == (-(-n_out // 16), n_in, 16)
    y = panel_gemm.linear(x, panels, b, n_out)
    want = x.double() @ w.double().t() + (b.double() if bias else 0)
    torch.testing.assert_close(y, want.float(), rtol=1e-5, atol=1e-4 * n_in**0.5)


def test_a_rows_result_depends_on_neither_batch_nor_threads():
    """Each output is one in-order FMA chain: a sequence's logits do not change with the
    decode batch it shares a step with, nor with the thread count."""
    w, x = torch.randn(200, 384), torch.randn(20, 384)
    panels = panel_gemm.pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = panel_gemm.linear(x, panels, None, 200)
        torch.set_num_threads(1)
        one_thread = panel_gemm.linear(x, panels, None, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(full, one_thread)
    for m in (1, 2, 6, 7, 12, 16, 17):
        assert torch.equal(panel_gemm.linear(x[:m], panels, None, 200), full[:m])
    assert torch.equal(panel_gemm.linear(x[5:6], panels, None, 200), full[5:6])
