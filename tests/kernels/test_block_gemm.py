"""Linears on GGUF blocks as stored (kernels/cpu_block_dot.c): the widened rows equal the gguf
package's dequantization bit for bit; the int8-activation product equals, bit for bit, a numpy
replay of its integer sums and fp32 steps; a row's bits depend on neither its batch, nor the thread
count, nor the instruction set (every build the machine can run). Blocks are random bytes (every
bit pattern: negative Q6_K scales, Q8_0's -128) with finite fp16 scales."""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import block_gemm
from pdserve.kernels.block_gemm import TYPES, BlockWeight
from pdserve.modelgen.random_blocks import random_blocks
from tests.kernels.isa_builds import ISAS, isa_variant

pytestmark = pytest.mark.skipif(not block_gemm.available(), reason="no C compiler")

Q = gguf.GGMLQuantizationType


def random_weight(qtype: int, out: int, n_in: int, seed: int) -> BlockWeight:
    return BlockWeight(qtype, torch.from_numpy(random_blocks(Q(qtype), out, n_in, seed)), n_in)


def gguf_dequant(w: BlockWeight) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(w.blocks.numpy(), Q(w.qtype)), dtype=np.float32))


def _q8k(x: np.ndarray):
    """x [m, in] fp32 -> (xq int64 [m, S, 256], dx fp32 [m, S], bsums int64 [m, S, 16]): the kernel's rule."""
    g = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    amax = np.abs(g).max(-1)  # [m, S]
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    xq = np.rint(g * inv[..., None]).astype(np.int64)
    return xq, (amax / np.float32(127)).astype(np.float32), xq.reshape(*xq.shape[:2], 16, 16).sum(-1)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _integers(w: BlockWeight):
    """Per (out, super-block): the kernel's integer factors and fp16 scales, from the bytes."""
    out, nsb = w.out_features, w.in_features // 256
    b = w.blocks.numpy().reshape(out, nsb, -1)
    if w.qtype in (Q.Q4_K, Q.Q5_K):
        p = b[..., 4:16].astype(np.int64)
        sc = np.concatenate([p[..., 0:4] & 63, (p[..., 8:12] & 15) | ((p[..., 0:4] >> 6) << 4)], -1)
        mn = np.concatenate([p[..., 4:8] & 63, (p[..., 8:12] >> 4) | ((p[..., 4:8] >> 6) << 4)], -1)
        qs = b[..., 16:144] if w.qtype == Q.Q4_K else b[..., 48:176]
        v = np.stack([qs.reshape(out, nsb, 4, 32) & 15, qs.reshape(out, nsb, 4, 32) >> 4], 3)  # [o, S, 4, 2, 32]
        v = v.reshape(out, nsb, 8, 32).astype(np.int64)
        if w.qtype == Q.Q5_K:
            qh = b[..., 16:48].astype(np.int64)
            v |= ((qh[:, :, None, :] >> np.arange(8)[:, None]) & 1) << 4
        return v, sc, mn, _f16(b[..., 0:2]), _f16(b[..., 2:4])
    if w.qtype == Q.Q6_K:
        ql, qh = b[..., :128].reshape(out, nsb, 2, 64), b[..., 128:192].reshape(out, nsb, 2, 32)
        low = np.stack([ql[..., :32] & 15, ql[..., 32:] & 15, ql[..., :32] >> 4, ql[..., 32:] >> 4], 3)  # [o,S,2,4,32]
        high = np.stack([(qh >> s) & 3 for s in (0, 2, 4, 6)], 3)
        u = (low | (high << 4)).reshape(out, nsb, 16, 16).astype(np.int64)
        return u, b[..., 192:208].view(np.int8).astype(np.int64), None, _f16(b[..., 208:210]), None
    blk = b.reshape(out, nsb, 8, 34)
    return blk[..., 2:].view(np.int8).astype(np.int64), None, None, _f16(blk[..., 0:2]), None


def replay(x: torch.Tensor, w: BlockWeight) -> torch.Tensor:
    """The kernel's arithmetic in numpy: exact integers in 8 lanes (lane k: inputs 4k..4k+3 of every
    32), each super-block's lanes widened and scaled into 8 fp32 lanes, then the lanes in order."""
    xq, dx, bsums = _q8k(x.numpy())
    v, sc, mn, d, dmin = _integers(w)
    m, nsb = xq.shape[:2]
    f32 = np.float32
    acc = np.zeros((m, w.out_features, 8), dtype=f32)

    def add(acc, lanes, f):  # f [m, o]: the product rounded, then added
        return (acc + (lanes.astype(f32) * f[..., None]).astype(f32)).astype(f32)

    for s in range(nsb):
        xs = xq[:, s]
        if w.qtype in (Q.Q4_K, Q.Q5_K):
            dots = np.einsum("ojkl,mjkl->mojk", v[:, s].reshape(-1, 8, 8, 4), xs.reshape(m, 8, 8, 4))
            lanes = (dots * sc[None, :, s, :, None]).sum(2)  # [m, o, 8]
            mins = mn[None, :, s] * bsums[:, s].reshape(m, 8, 2).sum(-1)[:, None]  # [m, o, 8]
            acc = add(acc, lanes, (d[None, :, s] * dx[:, s, None]).astype(f32))
            acc = add(acc, mins, -(dmin[None, :, s] * dx[:, s, None]).astype(f32))
        elif w.qtype == Q.Q6_K:
            dots = np.einsum("ogkl,mgkl->mogk", v[:, s].reshape(-1, 16, 4, 4), xs.reshape(m, 16, 4, 4))
            scaled = dots * sc[None, :, s, :, None]  # [m, o, 16 groups, 4]
            lanes = scaled.reshape(m, -1, 8, 2, 4).sum(2).reshape(m, -1, 8)  # group parity picks lanes 0-3 / 4-7
            bias = (sc[None, :, s] * bsums[:, s, None]).reshape(m, -1, 8, 2).sum(-1)  # [m, o, 8]
            acc = add(acc, lanes - 32 * bias, (d[None, :, s] * dx[:, s, None]).astype(f32))
        else:
            dots = np.einsum("obkl,mbkl->mobk", v[:, s].reshape(-1, 8, 8, 4), xs.reshape(m, 8, 8, 4))  # [m, o, 8, 8]
            for k in range(8):
                acc = add(acc, dots[:, :, k], (d[None, :, s, k] * dx[:, s, None]).astype(f32))
    total = np.zeros(acc.shape[:2], dtype=f32)
    for lane in range(8):
        total = (total + acc[..., lane]).astype(f32)
    return torch.from_numpy(total)


@pytest.mark.parametrize("qtype", list(TYPES))
def test_widened_rows_are_the_gguf_packages_values(qtype):
    w = random_weight(qtype, 40, 512, qtype)
    want = gguf_dequant(w)
    assert torch.equal(block_gemm.dequantize_rows(w), want)
    ids = torch.tensor([7, 0, 39, 7])
    assert torch.equal(block_gemm.dequantize_rows(w, ids), want[ids])
    assert torch.equal(block_gemm.dequantize_rows(w, o0=3, o1=9), want[3:9])


@pytest.mark.parametrize("qtype", list(TYPES))
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_product_equals_its_replay_and_is_close_to_the_float_one(qtype, rows):
    g = torch.Generator().manual_seed(qtype * 10 + rows)
    w = random_weight(qtype, 70, 768, qtype + rows)
    x = torch.randn(rows, 780, generator=g)[:, :768]  # rows apart, as from a wider tensor
    x[0, :256] = 0.0  # an all-zero super-block
    y = block_gemm.linear(x, w, None)
    assert torch.equal(y, replay(x, w))
    exact = F.linear(x.double(), gguf_dequant(w).double())
    assert ((y - exact).abs().max() / exact.abs().max()).item() < 2e-2
    b = torch.randn(70, generator=g)
    torch.testing.assert_close(block_gemm.linear(x, w, b), y + b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("qtype", list(TYPES))
def test_a_prompts_many_rows_take_the_same_kernel_each_row_as_alone(qtype):
    """Tiles of 8, 4, 2 and 1 rows over blocks of weight rows: 45 rows give the replay's bits, and
    each row the bits it has alone (so a prompt's KV does not depend on its chunking)."""
    w = random_weight(qtype, 40, 512, qtype)
    x = torch.randn(45, 512, generator=torch.Generator().manual_seed(qtype))
    y = block_gemm.linear(x, w, None)
    assert torch.equal(y, replay(x, w))
    assert torch.equal(torch.cat([block_gemm.linear(x[i : i + 1], w, None) for i in range(0, 45, 11)]), y[::11])


def test_a_row_length_that_is_not_whole_super_blocks_is_refused():
    with pytest.raises(ValueError, match="inputs a row"):
        BlockWeight(int(Q.Q4_K), torch.zeros(2, 144, dtype=torch.uint8), 200)
    assert not block_gemm.readable(int(Q.Q4_K), 200) and block_gemm.readable(int(Q.Q6_K), 512)
    assert not block_gemm.readable(int(Q.Q4_0), 512)


def _gemm(lib: ctypes.CDLL, x: torch.Tensor, w: BlockWeight, threads: int) -> torch.Tensor:
    y = torch.empty(x.shape[0], w.out_features)
    rc = lib.block_gemm_int8x(
        x.data_ptr(),
        x.stride(0),
        w.blocks.data_ptr(),
        None,
        y.data_ptr(),
        x.shape[0],
        w.in_features,
        w.out_features,
        w.qtype,
        threads,
    )
    assert rc == 0
    return y


@pytest.fixture(scope="module", params=list(ISAS))
def isa_build(request, tmp_path_factory) -> tuple[str, ctypes.CDLL]:
    lib = isa_variant(
        request.param,
        block_gemm.SOURCE,
        tmp_path_factory.mktemp(request.param),
        block_gemm._library(),
        "block_gemm_int8x",
    )
    return request.param, lib


@pytest.mark.parametrize("qtype", list(TYPES))
def test_every_isa_build_gives_a_row_the_same_bits_in_any_batch(isa_build, qtype):
    """Each build the machine can run (plain SSE2 C, AVX2, AVX-512): the same bits as this machine's
    own build, whatever the batch or thread count."""
    _, lib = isa_build
    w = random_weight(qtype, 75, 512, 100 + qtype)
    x = torch.randn(9, 520, generator=torch.Generator().manual_seed(qtype))[:, :512]
    full = _gemm(lib, x, w, 2)
    assert torch.equal(_gemm(lib, x, w, 1), full)
    assert torch.equal(torch.cat([_gemm(lib, x[i : i + 1], w, 1) for i in range(9)]), full)
    assert torch.equal(_gemm(block_gemm._library(), x, w, 1), full)
