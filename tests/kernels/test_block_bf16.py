"""Prompts' linears on GGUF blocks in bf16 (kernels/cpu_block_bf16.c): the product equals, bit for
bit, a numpy replay of its rounding (x and the widened weight to bf16, each pair of inputs added odd
first, every sum in fp32); a row's bits depend on neither its batch, nor the thread count, nor the
instruction set (the AVX-512 BF16 instruction against fp32 multiply-adds on every other build)."""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest
import torch

from pdserve.kernels import block_gemm
from pdserve.kernels.block_gemm import TYPES, BlockWeight
from tests.kernels.isa_builds import ISAS, isa_variant
from tests.kernels.test_block_gemm import gguf_dequant, random_weight

pytestmark = pytest.mark.skipif(not block_gemm.available(), reason="no C compiler")


def bf16(t: torch.Tensor) -> np.ndarray:
    """fp32 -> bf16 (round to nearest even) -> fp32, as numpy."""
    return t.to(torch.bfloat16).float().numpy()


def replay(x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None) -> np.ndarray:
    """The kernel's sums: per pair of inputs, x[2p + 1] w[2p + 1] then x[2p] w[2p], each rounded."""
    xs, ws = bf16(x), bf16(gguf_dequant(w))
    acc = np.zeros((x.shape[0], w.out_features), np.float32)
    for p in range(w.in_features // 2):
        for k in (2 * p + 1, 2 * p):
            acc = (acc + xs[:, k : k + 1] * ws[None, :, k]).astype(np.float32)
    return acc if bias is None else (acc + bias.numpy()).astype(np.float32)


@contextlib.contextmanager
def on(lib, threads: int = 1):
    """`block_gemm.linear_bf16` on `lib` (a build of the kernel) and `threads` threads, while open."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with mock.patch.object(block_gemm, "_bf16_library", lambda: lib):
            yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", list(TYPES))
def test_bf16_product_equals_its_replay(qtype):
    """100 outputs (a panel of 64 and a part one), 13 rows (two tiles of 6 and one row), a bias."""
    w = random_weight(qtype, 100, 512, seed=qtype)
    x, bias = torch.randn(13, 512, generator=torch.Generator().manual_seed(1)), torch.randn(100)
    got = block_gemm.linear_bf16(x, w, bias)
    np.testing.assert_array_equal(got.numpy(), replay(x, w, bias))
    np.testing.assert_array_equal(block_gemm.linear_bf16(x, w, None).numpy(), replay(x, w, None))
    # close to the fp32 product: bf16 keeps 8 bits of each factor
    exact = x.double() @ gguf_dequant(w).double().T + bias.double()
    assert (got.double() - exact).abs().max() < 2e-2 * exact.abs().max()


@pytest.mark.parametrize("qtype", list(TYPES))
def test_a_rows_bits_depend_on_no_other_row_nor_the_threads(qtype):
    w = random_weight(qtype, 130, 768, seed=5)
    x = torch.randn(20, 768, generator=torch.Generator().manual_seed(2))
    whole = block_gemm.linear_bf16(x, w, None)
    for rows in (slice(0, 1), slice(3, 10), slice(7, 20)):
        assert torch.equal(block_gemm.linear_bf16(x[rows], w, None), whole[rows])
    for threads in (2, 3):
        with on(block_gemm._bf16_library(), threads):
            assert torch.equal(block_gemm.linear_bf16(x, w, None), whole)


@pytest.mark.parametrize("isa", ISAS)
def test_every_instruction_set_gives_the_same_bits(isa, tmp_path):
    """The machine's build (AVX-512 BF16 where it has it) against each older build's fp32 sums."""
    lib = isa_variant(isa, block_gemm.BF16_SOURCE, tmp_path, block_gemm._bf16_library(), "block_gemm_bf16")
    for qtype in TYPES:
        w = random_weight(qtype, 70, 512, seed=qtype + 1)
        x, bias = torch.randn(9, 512, generator=torch.Generator().manual_seed(qtype)), torch.randn(70)
        with on(lib):
            assert block_gemm._bf16_library() is lib  # (the call below runs the variant)
            theirs = block_gemm.linear_bf16(x, w, bias)
        assert torch.equal(theirs, block_gemm.linear_bf16(x, w, bias)), TYPES[qtype][0]


def test_rounding_to_bf16_is_to_nearest_even_and_flushes_denormals():
    """Halfway cases go to the even bf16, values below fp32's normal range to zero (as the
    instruction's conversion), so x's rounding is the same on every build."""
    w = BlockWeight(8, torch.from_numpy(np.zeros((1, 34 * 8), np.uint8)), 256)  # Q8_0, d = 0 ...
    blocks = w.blocks.numpy()
    blocks[0, 0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)  # ... but block 0: d = 1
    blocks[0, 2] = 1  # input 0's weight: 1
    one = torch.tensor([1.0], dtype=torch.float32)
    for value, want in (
        (1.0 + 2**-8, 1.0),  # halfway, to even (down)
        (1.0 + 3 * 2**-8, 1.0 + 2**-6),  # halfway, to even (up)
        (1.0 + 2**-8 + 2**-20, 1.0 + 2**-7),  # above halfway
        (1e-39, 0.0),  # an fp32 denormal
    ):
        x = torch.zeros(1, 256)
        x[0, 0] = value * one
        assert block_gemm.linear_bf16(x, w, None).item() == want, value
