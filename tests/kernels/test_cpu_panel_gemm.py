"""The C few-row GEMM (kernels/cpu_panel_gemm.c) on panel-packed weights, against float64."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pdserve.kernels import panel_gemm
from tests.kernels.isa_builds import build, cannot_run

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


@pytest.mark.parametrize("n_in,n_out", [(96, 40), (576, 960), (1536, 576)])
@pytest.mark.parametrize("rows", [1, 5, 7, 16, 17, 32])
def test_bf16_weights_sum_in_fp32_and_round_once(n_in, n_out, rows):
    """bf16 panels, inputs, bias and outputs: each output is the fp32 sum rounded to bf16 once, so
    it lies within one bf16 step of the float64 result rounded, and nearly always on it."""
    g = torch.Generator().manual_seed(n_in + n_out + rows)
    w, b = torch.randn(n_out, n_in, generator=g).bfloat16(), torch.randn(n_out, generator=g).bfloat16()
    x = torch.randn(rows, n_in + 5, generator=g).bfloat16()[:, :n_in]  # rows apart
    panels = panel_gemm.pack(w)
    assert panels.dtype == torch.bfloat16 and panels.shape == (-(-n_out // 16), n_in, 16)
    y = panel_gemm.linear(x, panels, b, n_out)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n_out)
    exact = x.double() @ w.double().t() + b.double()
    step = exact.abs().clamp(min=1e-3) * 2**-7  # a bf16 step at each output's magnitude
    assert ((y.double() - exact).abs() <= step).all()
    assert (y == exact.bfloat16()).double().mean() > 0.98
    # a row's bits do not depend on the rows beside it
    assert torch.equal(panel_gemm.linear(x[:1], panels, b, n_out), y[:1])


@pytest.mark.skipif(cannot_run("avx2") is not None, reason=str(cannot_run("avx2")))
def test_the_ymm_only_build_gives_the_same_bits(tmp_path):
    """The AVX2 build (6-row ymm tiles only) and this machine's (with AVX-512: 7-16-row zmm tiles
    too) sum every output in the same order: equal bit for bit at every row count, so a sequence's
    logits do not depend on the CPU's vector width either."""
    avx2 = build(panel_gemm.SOURCE, "avx2", tmp_path)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    avx2.panel_gemm_f32.argtypes = [p, i64, p, p, p, i64, i64, i64, ctypes.c_int]
    assert avx2.panel_tile_rows() == 6
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(72, 200, generator=g), torch.randn(72, generator=g)
    panels = panel_gemm.pack(w)
    for m in range(1, 34):
        x = torch.randn(m, 200, generator=g)
        want = torch.empty(m, 72)
        avx2.panel_gemm_f32(x.data_ptr(), 200, panels.data_ptr(), b.data_ptr(), want.data_ptr(), m, 200, 72, 1)
        assert torch.equal(panel_gemm.linear(x, panels, b, 72), want), m
