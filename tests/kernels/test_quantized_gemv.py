"""The weight-only int8 / int4 linear (kernels/cpu_quant_gemm.c via kernels/quant_gemm.py) equals
torch on the dequantized weight up to fp32 accumulation order: our own quantization and GGUF's
Q8_0 / Q4_0 blocks (made by gguf.quants.quantize) alike."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.quantize import from_gguf_blocks, quantize
from pdserve.kernels import quant_gemm
from pdserve.kernels.quant_gemm import QuantWeight, dequantize
from tests.kernels.isa_builds import ISAS, isa_variant

pytestmark = pytest.mark.skipif(not quant_gemm.available(), reason="no C compiler: torch reference only")

Q = gguf.GGMLQuantizationType


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


def close(y: torch.Tensor, want: torch.Tensor, n_in: int) -> None:
    torch.testing.assert_close(y, want, rtol=1e-5, atol=2e-5 * n_in**0.5)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("n_out,n_in", [(40, 96), (17, 64), (7, 33), (1728, 576), (576, 1536), (5, 200)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 16, 17, 40])
def test_matches_torch_on_the_dequantized_weight(scheme, n_out, n_in, rows):
    g = torch.Generator().manual_seed(n_out * 31 + n_in + rows)
    w = quantize(torch.randn(n_out, n_in, generator=g), scheme)
    b = torch.randn(n_out, generator=g) if rows % 2 else None
    x = torch.randn(rows, n_in + 5, generator=g)[:, :n_in]  # rows apart, as from a wider tensor
    close(quant_gemm.linear(x, w, b), reference(x, dequantize(w), b), n_in)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0])
@pytest.mark.parametrize("rows", [1, 4, 16, 64])
def test_gguf_blocks_map_as_stored(qtype, rows):
    rng = np.random.default_rng(rows)
    n_out, n_in = 97, 320
    dense = rng.standard_normal((n_out, n_in)).astype(np.float32)
    blocks = gguf.quants.quantize(dense, qtype)  # uint8 [out, bytes]
    w = from_gguf_blocks(blocks, qtype, n_in)
    want_w = torch.from_numpy(np.array(gguf.quants.dequantize(blocks, qtype), dtype=np.float32))
    torch.testing.assert_close(dequantize(w), want_w, rtol=0, atol=0)  # the same values, exactly
    x = torch.from_numpy(rng.standard_normal((rows, n_in)).astype(np.float32))
    close(quant_gemm.linear(x, w, None), reference(x, want_w, None), n_in)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_own_quantization_is_close_and_small(scheme):
    w = torch.randn(300, 512)
    q = quantize(w, scheme)
    step = (w.abs().amax() / (127 if scheme == "int8" else 7)).item()
    assert (dequantize(q) - w).abs().max().item() <= step
    ratio = q.nbytes() / (w.numel() * 4)
    assert ratio <= (0.3 if scheme == "int8" else 0.16)  # int8: 1 + 4/32 bytes a weight; int4: 0.5 + 4/32


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_rows_result_depends_on_neither_batch_nor_threads(scheme):
    """Each (output, row) has one accumulator summed in the same order whatever shares the call."""
    w, x = quantize(torch.randn(203, 384), scheme), torch.randn(13, 384)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = quant_gemm.linear(x, w, None)
        torch.set_num_threads(1)
        one_thread = quant_gemm.linear(x, w, None)
    finally:
        torch.set_num_threads(threads)
    singles = torch.cat([quant_gemm.linear(x[i : i + 1], w, None) for i in range(13)])
    assert torch.equal(full, one_thread) and torch.equal(full, singles)


def test_many_rows_use_widened_tiles():
    """Past FEW_ROWS the weight is widened TILE_OUT rows at a time: outputs across tiles join."""
    w = quantize(torch.randn(quant_gemm.TILE_OUT + 37, 64), "int4")
    x, b = torch.randn(quant_gemm.FEW_ROWS[4] + 3, 64), torch.randn(quant_gemm.TILE_OUT + 37)
    close(quant_gemm.linear(x, w, b), reference(x, dequantize(w), b), 64)


FORMATS = [(8, 32, False), (8, 16, True), (4, 32, False), (4, 32, True), (4, 16, True)]  # bits, scale group, affine


def _weight(bits: int, sg: int, affine: bool, n_out: int, n_in: int, g: torch.Generator) -> QuantWeight:
    q = (
        torch.randint(-128, 128, (n_out, n_in), generator=g)
        if bits == 8
        else torch.randint(0, 256, (n_out, n_in // 2), generator=g)
    )
    scales = torch.rand(n_out, n_in // sg, generator=g) * 0.1
    offsets = torch.randn(n_out, n_in // sg, generator=g) * 0.1 if affine else None
    return QuantWeight(bits, q.to(torch.int8 if bits == 8 else torch.uint8), scales, n_in, offsets, sg)


def _gemm(lib: ctypes.CDLL, x: torch.Tensor, w: QuantWeight, threads: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.out_features)
    offsets = None if w.offsets is None else w.offsets.data_ptr()
    args = (x.data_ptr(), x.stride(0), w.q.data_ptr(), w.scales.data_ptr(), offsets, None, y.data_ptr())
    assert lib.quant_gemm_f32(*args, x.shape[0], w.padded_in, w.out_features, w.bits, w.scale_group, threads) == 0
    return y


@pytest.fixture(scope="module", params=list(ISAS))
def isa_build(request, tmp_path_factory) -> tuple[str, ctypes.CDLL]:
    lib = isa_variant(
        request.param,
        quant_gemm.SOURCE,
        tmp_path_factory.mktemp(request.param),
        quant_gemm._library(),
        "quant_gemm_f32",
    )
    return request.param, lib


@pytest.mark.parametrize("bits,sg,affine", FORMATS)
def test_every_isa_build_gives_a_row_the_same_bits_in_any_batch(isa_build, bits, sg, affine):
    """Each vector path the machine can run (SSE2, AVX2, AVX-512), built as such: a row's bits do not
    depend on its batch (every tile shape) nor on the thread count; the FMA builds (AVX2, AVX-512)
    also equal this machine's own build, so a result does not depend on the CPU's vector width."""
    isa, lib = isa_build
    g = torch.Generator().manual_seed(bits * 100 + sg + affine)
    w, x = _weight(bits, sg, affine, 75, 320, g), torch.randn(21, 330, generator=g)[:, :320]  # rows apart
    full = _gemm(lib, x, w, 2)
    assert torch.equal(_gemm(lib, x, w, 1), full)
    for m in (1, 2, 3, 4, 5, 8, 21):
        assert torch.equal(_gemm(lib, x[:m], w, 1), full[:m]), m
    assert torch.equal(torch.cat([_gemm(lib, x[i : i + 1], w, 1) for i in range(21)]), full)
    if isa != "sse2":  # no FMA there: other bits
        assert torch.equal(_gemm(quant_gemm._library(), x, w, 1), full)
