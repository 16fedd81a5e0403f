"""The int8-activation quantized linear (kernels/cpu_quant_dot.c): equal, up to fp32 summation
order, to a torch reference that quantizes x per group of 32 (dx = max|x| / 127, xq = round(x / dx))
and multiplies by the dequantized weight; close to the fp32-activation kernel; a row's bits depend
on neither its batch, nor the thread count, nor the instruction set (AVX2 and AVX-512 builds)."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import quant_gemm
from pdserve.kernels.quant_gemm import QuantWeight, dequantize
from tests.kernels.isa_builds import ISAS, isa_variant
from tests.kernels.test_quantized_gemv import _weight  # random q, scales (and offsets) of one format

pytestmark = pytest.mark.skipif(not quant_gemm.int8x_available(), reason="no C compiler: torch reference only")

FORMATS = [(8, 32, False), (8, 16, False), (8, 32, True), (4, 32, False), (4, 32, True), (4, 16, True)]


def quantized_rows(x: torch.Tensor) -> torch.Tensor:
    """x [m, in] -> the values its int8 form stands for: per group of 32, round(x / dx) * dx."""
    g = x.reshape(x.shape[0], -1, 32)  # [m, G, 32]
    amax = g.abs().amax(-1, keepdim=True)  # [m, G, 1]
    q = torch.where(amax > 0, torch.round(g * (127 / amax)), torch.zeros_like(g))
    return (q * (amax / 127)).reshape(x.shape)


@pytest.mark.parametrize("bits,sg,affine", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17])
def test_equals_the_reference_on_int8_rows(bits, sg, affine, rows):
    g = torch.Generator().manual_seed(bits * 1000 + sg * 10 + affine + rows)
    w = _weight(bits, sg, affine, 70, 320, g)
    x = torch.randn(rows, 330, generator=g)[:, :320]  # rows apart, as from a wider tensor
    x[0, :32] = 0.0  # an all-zero group
    b = torch.randn(70, generator=g) if rows % 2 else None
    y = quant_gemm.linear(x, w, b, int8_activations=True)
    want = F.linear(quantized_rows(x).double(), dequantize(w).double(), None if b is None else b.double()).float()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-4)
    fp32 = quant_gemm.linear(x, w, b)  # activations kept: within the activations' rounding
    assert ((y - fp32).abs().max() / fp32.abs().max()).item() < 2e-2


def _gemm(lib: ctypes.CDLL, x: torch.Tensor, w: QuantWeight, threads: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.out_features)
    offsets = None if w.offsets is None else w.offsets.data_ptr()
    args = (x.data_ptr(), x.stride(0), w.q.data_ptr(), w.scales.data_ptr(), offsets, None, y.data_ptr())
    assert lib.quant_gemm_int8x(*args, x.shape[0], w.padded_in, w.out_features, w.bits, w.scale_group, threads) == 0
    return y


@pytest.fixture(scope="module", params=list(ISAS))
def isa_build(request, tmp_path_factory) -> tuple[str, ctypes.CDLL]:
    lib = isa_variant(
        request.param,
        quant_gemm.INT8X_SOURCE,
        tmp_path_factory.mktemp(request.param),
        quant_gemm._int8x_library(),
        "quant_gemm_int8x",
    )
    return request.param, lib


@pytest.mark.parametrize("bits,sg,affine", FORMATS)
def test_every_isa_build_gives_a_row_the_same_bits_in_any_batch(isa_build, bits, sg, affine):
    """Each vector path the machine can run, built as such: a row's bits do not depend on its batch
    (every tile shape) nor on the thread count; the FMA builds also equal this machine's own."""
    isa, lib = isa_build
    g = torch.Generator().manual_seed(bits * 100 + sg + affine)
    w, x = _weight(bits, sg, affine, 75, 320, g), torch.randn(21, 330, generator=g)[:, :320]
    full = _gemm(lib, x, w, 2)
    assert torch.equal(_gemm(lib, x, w, 1), full)
    for m in (1, 2, 3, 4, 5, 8, 21):
        assert torch.equal(_gemm(lib, x[:m], w, 1), full[:m]), m
    assert torch.equal(torch.cat([_gemm(lib, x[i : i + 1], w, 1) for i in range(21)]), full)
    if isa != "sse2":  # no FMA there: other bits
        assert torch.equal(_gemm(quant_gemm._int8x_library(), x, w, 1), full)
