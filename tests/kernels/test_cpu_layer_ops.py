"""The C layer ops (kernels/cpu_layer_ops.c) against their torch formulas (HF's), in float64 as
the reference: RMSNorm, the residual add fused into it, silu(gate) * up."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.env import reload as reload_env
from pdserve.kernels import layer_ops

pytestmark = pytest.mark.skipif(not layer_ops.native_available(), reason="no C compiler: torch path only")


def _norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return (w.double() * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).float()


@pytest.mark.parametrize("rows,n", [(1, 512), (3, 64), (37, 520), (512, 4096), (5, 13)])
def test_rms_norm_and_fused_add(rows, n):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    x, d = torch.randn(rows, n, generator=g) * 3, torch.randn(rows, n, generator=g)
    w = torch.randn(n, generator=g)
    out = layer_ops.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(out, _norm64(x, w, 1e-5), rtol=2e-6, atol=2e-6)
    total, normed = layer_ops.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(total, x + d)  # one fp32 add, as torch does it
    torch.testing.assert_close(normed, _norm64(x + d, w, 1e-5), rtol=2e-6, atol=2e-6)


def test_norm_reads_strided_rows():
    """Rows apart (a slice of a wider tensor) are read in place."""
    base = torch.randn(6, 96)
    x, w = base[:, :64], torch.randn(64)
    assert not x.is_contiguous()
    torch.testing.assert_close(layer_ops.rms_norm(x, w, 1e-6), _norm64(x, w, 1e-6), rtol=2e-6, atol=2e-6)
    d = base[:, 32:]
    total, normed = layer_ops.add_rms_norm(torch.randn(6, 64), d, w, 1e-6)
    torch.testing.assert_close(normed, _norm64(total, w, 1e-6), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 100), (512, 1536)])
def test_silu_mul(rows, inter):
    gate_up = torch.randn(rows, 2 * inter) * 6  # reaches exp's far ends
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.double().split(inter, dim=-1)
    ref = (F.silu(gate) * up).float()
    torch.testing.assert_close(layer_ops.silu_mul(gate_up), ref, rtol=2e-6, atol=1e-6)


def test_results_do_not_depend_on_thread_count():
    x, d, w, gu = torch.randn(64, 512), torch.randn(64, 512), torch.randn(512), torch.randn(64, 3072)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (layer_ops.rms_norm(x, w, 1e-6), *layer_ops.add_rms_norm(x, d, w, 1e-6), layer_ops.silu_mul(gu))
        torch.set_num_threads(2)
        two = (layer_ops.rms_norm(x, w, 1e-6), *layer_ops.add_rms_norm(x, d, w, 1e-6), layer_ops.silu_mul(gu))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_other_dtypes_and_the_switch_take_torch(monkeypatch):
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(64, dtype=torch.bfloat16)
    assert torch.equal(layer_ops.rms_norm(x, w, 1e-6), layer_ops.rms_norm_torch(x, w, 1e-6))
    monkeypatch.setenv("PDSERVE_LAYER_OPS", "torch")
    reload_env()
    x32, w32 = torch.randn(4, 64), torch.randn(64)
    assert torch.equal(layer_ops.rms_norm(x32, w32, 1e-6), layer_ops.rms_norm_torch(x32, w32, 1e-6))


def _rotate64(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x = x.double()
    return x * cos.double() + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin.double()


@pytest.mark.parametrize("hq,hkv,d", [(8, 4, 64), (4, 4, 16), (7, 1, 128)])
def test_rope_store_rotates_and_stores_like_torch(hq, hkv, d):
    rows, blocks, bs = 11, 6, 4
    width = (hq + 2 * hkv) * d
    qkv = torch.randn(rows, width + 8)[:, :width]  # rows apart, as from a wider projection
    pos = torch.randint(0, 500, (rows,))
    freqs = pos[:, None].float() * (1e4 ** (-torch.arange(0, d, 2).float() / d))[None]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)  # [T, 1, D], as RotaryEmbedding.tables
    kv = torch.full((2, blocks, bs, hkv, d), 7.0)
    slots = torch.randperm(blocks * bs)[:rows]
    slots[3] = -1  # not stored
    q, k, v = layer_ops.rope_store(qkv, cos, sin, hq, hkv, kv, slots)
    heads = qkv.view(rows, hq + 2 * hkv, d)
    torch.testing.assert_close(q, _rotate64(heads[:, :hq], cos, sin).float(), rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(k, _rotate64(heads[:, hq : hq + hkv], cos, sin).float(), rtol=1e-6, atol=2e-6)
    assert torch.equal(v, heads[:, hq + hkv :])
    flat = kv.view(2, blocks * bs, hkv, d)
    stored = slots >= 0
    assert torch.equal(flat[0, slots[stored]], k[stored]) and torch.equal(flat[1, slots[stored]], v[stored])
    untouched = torch.ones(blocks * bs, dtype=torch.bool)
    untouched[slots[stored]] = False
    assert bool((flat[:, untouched] == 7.0).all())  # nothing else written (slot -1 included)


def test_rope_store_refuses_a_slot_past_the_pool():
    kv = torch.zeros(2, 2, 4, 1, 8)
    qkv, cs = torch.randn(2, 24), torch.ones(2, 1, 8)
    with pytest.raises(IndexError):
        layer_ops.rope_store(qkv, cs, cs, 1, 1, kv, torch.tensor([0, 8]))
    assert bool((kv == 0).all())
