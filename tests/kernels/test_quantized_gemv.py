"""The weight-only int8 / int4 linear (kernels/cpu_quant_gemm.c via kernels/quant_gemm.py) equals
torch on the dequantized weight up to fp32 accumulation order: our own quantization and GGUF's
Q8_0 / Q4_0 blocks (made by gguf.quants.quantize) alike."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.quantize import from_gguf_blocks, quantize
from pdserve.kernels import quant_gemm
from pdserve.kernels.quant_gemm import dequantize

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
