"""The C one-row linear (kernels/cpu_gemv.c) against float64, and where the model uses it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdserve.engine.models.cpu_linear import TransposedLinear
from pdserve.env import reload as reload_env
from pdserve.kernels import cpu_native
from tests.kernels.test_cpu_native_attention import HAVE_CC

needs_kernel = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the kernel is not built")


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("n_in,n_out", [(512, 1024), (1536, 512), (7, 13), (3, 8), (130, 8195)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64(n_in, n_out, with_bias, restore_threads):
    g = torch.Generator().manual_seed(n_in * n_out)
    x, w = torch.randn(1, n_in, generator=g), torch.randn(n_in, n_out, generator=g)
    bias = torch.randn(n_out, generator=g) if with_bias else None
    want = x.double() @ w.double() + (0 if bias is None else bias.double())
    outs = []
    for threads in (1, 2, 3):  # odd column splits and a tail that is not a multiple of 8
        torch.set_num_threads(threads)
        y = cpu_native.gemv(x, w, bias)
        assert y.shape == (1, n_out)
        torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5 * n_in**0.5)
        outs.append(y)
    # each column is summed over `in` in the same order whichever thread owns it
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_kernel
@pytest.mark.parametrize("n_in,n_out", [(576, 960), (7, 13), (130, 8195)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_sums_in_fp32_and_rounds_once(n_in, n_out, with_bias, restore_threads):
    """bf16 input, weight, bias and output: within one bf16 step of the float64 result on the same
    bf16 values, nearly always on its rounding, the same bits at any thread count."""
    g = torch.Generator().manual_seed(n_in + n_out)
    x, w = torch.randn(1, n_in, generator=g).bfloat16(), torch.randn(n_in, n_out, generator=g).bfloat16()
    bias = torch.randn(n_out, generator=g).bfloat16() if with_bias else None
    want = x.double() @ w.double() + (0 if bias is None else bias.double())
    outs = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        y = cpu_native.gemv(x, w, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (1, n_out)
        assert ((y.double() - want).abs() <= want.abs().clamp(min=1e-3) * 2**-7).all()
        assert (y == want.bfloat16()).double().mean() > 0.98
        outs.append(y)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_kernel
def test_a_bf16_layer_without_panels_takes_it_for_one_row(monkeypatch):
    """A bf16 model whose panel copy does not fit (TransposedLinear without panels): one row on
    the C bf16 GEMV, more on torch's matmul."""
    dense = nn.Linear(64, 96, bias=True).bfloat16()
    lin = TransposedLinear(dense)
    assert lin.native_gemv and lin.panels is None
    calls = []
    real = cpu_native.gemv
    monkeypatch.setattr(cpu_native, "gemv", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        one, three = torch.randn(1, 64).bfloat16(), torch.randn(3, 64).bfloat16()
        for x in (one, three):
            want = x.double() @ dense.weight.double().t() + dense.bias.double()
            torch.testing.assert_close(lin(x).double(), want, rtol=2**-7, atol=2**-7)
    assert len(calls) == 1


@needs_kernel
def test_the_model_linear_takes_it_for_one_row_only(monkeypatch):
    dense = nn.Linear(64, 96, bias=True)
    lin = TransposedLinear(dense)
    assert lin.native_gemv
    calls = []
    real = cpu_native.gemv
    monkeypatch.setattr(cpu_native, "gemv", lambda *a: calls.append(1) or real(*a))
    with torch.inference_mode():
        one, three = torch.randn(1, 64), torch.randn(3, 64)
        torch.testing.assert_close(lin(one), dense(one), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lin(three), dense(three), rtol=1e-5, atol=1e-5)
    assert len(calls) == 1  # three rows stay on torch


def test_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_GEMV", "torch")
    reload_env()
    assert not TransposedLinear(nn.Linear(8, 8)).native_gemv
