"""Attention over an int8 KV pool (--kv-cache-dtype int8, kernels/kv_int8.py): the C decode and
flash prefill kernels and the torch path, each against the float64 reference on the dequantized
values (so the tolerance is float rounding's, not quantization's); the C store's bytes against
torch's quantize; every ISA build this CPU can run."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from pdserve import kernels
from pdserve.env import reload as reload_env
from pdserve.kernels import cpu_native, kv_int8, layer_ops, torch_attention
from tests.kernels.isa_builds import ISAS, isa_variant
from tests.kernels.test_torch_attention import MIXED, SHAPES, Case, make_case, reference

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernels are not built")
FLASH = cpu_native.FLASH_SOURCE
TIGHT = dict(atol=2e-5, rtol=1e-5)


def quantized(case: Case) -> tuple[torch.Tensor, Case]:
    """The case's pool as int8 rows [2, N, bs, Hkv, D + 4], and the case as those rows give it back
    (pool, history and this step's K/V dequantized): what the int8 kernels must match."""
    pool = kv_int8.quantize(case.kv_layer)  # [2, N, bs, Hkv, D + 4]
    back = dataclasses.replace(
        case,
        kv_layer=kv_int8.dequantize(pool),
        key=kv_int8.roundtrip(case.key),
        value=kv_int8.roundtrip(case.value),
        hist_k=[kv_int8.roundtrip(h) for h in case.hist_k],
        hist_v=[kv_int8.roundtrip(h) for h in case.hist_v],
    )
    return pool, back


def decode(case: Case, pool: torch.Tensor, **kw) -> torch.Tensor:
    nd = case.meta.num_decode_seqs
    out = torch.full_like(case.query[:nd], float("nan"))
    m = case.meta
    assert cpu_native.paged_decode_attention(
        case.query[:nd], pool, m.block_tables, m.context_lens, case.scale, out, **kw
    )
    return out


def flash(case: Case, pool: torch.Tensor, **kw) -> torch.Tensor:
    out = torch.full_like(case.query, float("nan"))
    m = case.meta
    first = m.num_decode_seqs
    assert cpu_native.paged_prefill_attention(
        case.query, pool, m.block_tables, m.cu_seqlens_q, m.context_lens, first, case.scale, out, FLASH, **kw
    )
    return out


def test_quantize_rows():
    """scale = max|x| / 127 after the values; round half to even; a zero row stays zero."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -127.0, 3.0, 0.0], [0.0] * 8])
    rows = kv_int8.quantize(x)
    assert rows.shape == (2, 12) and rows.dtype == torch.int8
    assert rows[0, :8].tolist() == [127, 0, 2, 2, 0, -127, 3, 0]
    assert kv_int8.scales(rows).tolist() == [1.0, 0.0]
    assert torch.equal(kv_int8.dequantize(rows[1:]), torch.zeros(1, 8))
    y = torch.randn(50, 64) * 7
    err = (kv_int8.roundtrip(y) - y).abs()
    assert bool((err <= y.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6)).all())  # half a step at most


def test_c_store_writes_torch_quantize_bytes():
    """The fused rotary + store (rope_store_q8) leaves the same pool bytes as torch's store."""
    if not layer_ops.native_available():
        pytest.skip("layer ops not built")
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, n, bs = 8, 2, 64, 6, 4
    qkv = torch.randn(9, (hq + 2 * hkv) * d, generator=g) * 3
    qkv[0, (hq + hkv) * d : (hq + hkv) * d + 4] = torch.tensor([127.0, -63.5, 0.5, 1.5])  # V ties
    cos, sin = torch.randn(9, 1, d, generator=g), torch.randn(9, 1, d, generator=g)
    slots = torch.tensor([0, 5, 3, -1, 7, 8, 23, 1, 2])
    pool = torch.zeros(2, n, bs, hkv, d + 4, dtype=torch.int8)
    fused = layer_ops.rope_store(qkv, cos, sin, hq, hkv, pool, slots)
    assert fused is not None
    _, k, v = fused
    want = torch.zeros_like(pool)
    torch_attention.store_kv(k, v, want, slots)
    assert torch.equal(pool, want)


@pytest.mark.parametrize("bs", [16, 4])
@pytest.mark.parametrize("hq,hkv,d", SHAPES + [(8, 1, 128)])
def test_decode_matches_reference_on_dequantized_values(bs, hq, hkv, d):
    ctx = (1, 5, 16, 17, 64, 3, 100)
    case = make_case([(1, c) for c in ctx], len(ctx), hq, hkv, d, bs, seed=bs * hq + d)
    pool, back = quantized(case)
    torch.testing.assert_close(decode(case, pool).double(), reference(back), **TIGHT)


@pytest.mark.parametrize("window,softcap", [(7, None), (None, 5.0), (20, 3.0)])
def test_decode_window_and_softcap_as_over_the_fp32_pool(window, softcap):
    """Same as the fp32 kernel (itself checked against references) on the dequantized pool."""
    ctx = (1, 9, 16, 40, 70)
    case = make_case([(1, c) for c in ctx], len(ctx), 8, 2, 64, 16, seed=5)
    pool, back = quantized(case)
    want = decode(back, back.kv_layer, window=window, softcap=softcap)
    torch.testing.assert_close(decode(case, pool, window=window, softcap=softcap), want, **TIGHT)


def test_decode_row_does_not_depend_on_the_batch_or_threads():
    """A sequence alone, or among others, or on one thread: its output within float rounding of the
    batch's (work spans follow the batch's context, so sums may split differently), and on any
    thread count the same bits."""
    ctx = (3, 100, 17, 250, 64)
    case = make_case([(1, c) for c in ctx], len(ctx), 8, 2, 64, 16, seed=9)
    pool, _ = quantized(case)
    full = decode(case, pool)
    for i, c in enumerate(ctx):
        one = make_case([(1, c)], 1, 8, 2, 64, 16, seed=9)
        one = dataclasses.replace(one, query=case.query[i : i + 1])
        m = case.meta
        out = torch.full_like(one.query, float("nan"))
        assert cpu_native.paged_decode_attention(
            one.query, pool, m.block_tables[i : i + 1], m.context_lens[i : i + 1], case.scale, out
        )
        torch.testing.assert_close(out, full[i : i + 1], atol=1e-6, rtol=1e-6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(decode(case, pool), full)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bs", [16, 4])
@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (9, 3, 64), (8, 1, 128), (4, 4, 32), (4, 2, 16)])
def test_flash_prefill_matches_reference_on_dequantized_values(bs, hq, hkv, d):
    if d % 16 and "avx512f" in open("/proc/cpuinfo").read():
        pytest.skip("head_dim off the AVX-512 vector: the flash kernel refuses it")
    case = make_case(MIXED, 3, hq, hkv, d, bs, seed=bs + hq + d)
    pool, back = quantized(case)
    nd = case.meta.num_decode_seqs
    torch.testing.assert_close(flash(case, pool)[nd:].double(), reference(back)[nd:], **TIGHT)


@pytest.mark.parametrize("window,softcap", [(9, None), (None, 4.0), (30, 2.0)])
def test_flash_window_and_softcap_as_over_the_fp32_pool(window, softcap):
    case = make_case([(40, 40), (9, 50), (33, 70)], 0, 8, 2, 64, 16, seed=6)
    pool, back = quantized(case)
    want = flash(back, back.kv_layer, window=window, softcap=softcap)
    torch.testing.assert_close(flash(case, pool, window=window, softcap=softcap), want, **TIGHT)


def test_flash_row_does_not_depend_on_the_batch():
    """Each (sequence, KV head, query tile) is one work item: a sequence alone, the same bits."""
    case = make_case([(40, 40), (9, 50), (33, 70)], 0, 8, 2, 64, 16, seed=12)
    pool, _ = quantized(case)
    full = flash(case, pool)
    m = case.meta
    for b in range(3):
        s, e = m.cu_seqlens_q_cpu[b], m.cu_seqlens_q_cpu[b + 1]
        out = torch.full_like(case.query, float("nan"))
        cu = torch.tensor([0, e - s], dtype=torch.int32)
        q = case.query[s:e]
        assert cpu_native.paged_prefill_attention(
            q, pool, m.block_tables[b : b + 1], cu, m.context_lens[b : b + 1], 0, case.scale, out[s:e], FLASH
        )
        assert torch.equal(out[s:e], full[s:e])


def test_torch_path_matches_reference_on_dequantized_values(monkeypatch):
    """PDSERVE_ATTENTION=torch: the store quantizes, gathers dequantize, whole-prompt chunks attend
    over their K/V as the pool holds them (a mixed batch: decodes, chunks with context, whole prompts)."""
    monkeypatch.setenv("PDSERVE_ATTENTION", "torch")
    reload_env()
    case = make_case(MIXED, 3, 8, 2, 32, 4, seed=13)
    pool, back = quantized(case)
    out = kernels.paged_attention(case.query, case.key, case.value, pool, case.meta, case.scale)
    torch.testing.assert_close(out.double(), reference(back), **TIGHT)


def test_dispatch_reads_int8_in_the_c_kernels(monkeypatch):
    monkeypatch.delenv("PDSERVE_ATTENTION", raising=False)
    reload_env()
    used = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, _r=real, _n=name, **kw: used.append(_n) or _r(*a, **kw))
    case = make_case(MIXED, 3, 8, 2, 64, 16, seed=14)
    pool, back = quantized(case)
    out = kernels.paged_attention(case.query, case.key, case.value, pool, case.meta, case.scale)
    assert used == ["paged_decode_attention", "paged_prefill_attention"]
    torch.testing.assert_close(out.double(), reference(back), **TIGHT)


@pytest.fixture(scope="module", params=list(ISAS))
def isa_builds(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    dec = isa_variant(
        request.param, cpu_native.ATTENTION_SOURCE, out, cpu_native._library(), "paged_decode_attention_q8"
    )
    fl = isa_variant(request.param, FLASH, out, cpu_native._prefill_library(FLASH), "prefill_flash_q8")
    return dec, fl


def test_every_isa_build_reads_int8_right(isa_builds, monkeypatch):
    """Plain SSE2, AVX2 and AVX-512 builds (those this CPU runs) of both kernels: the reference."""
    dec, fl = isa_builds
    monkeypatch.setattr(cpu_native, "_library", lambda: dec)
    monkeypatch.setattr(cpu_native, "_prefill_library", lambda source=FLASH: fl)
    case = make_case(MIXED, 3, 8, 2, 64, 16, seed=15)
    pool, back = quantized(case)
    nd = case.meta.num_decode_seqs
    want = reference(back)
    torch.testing.assert_close(decode(case, pool).double(), want[:nd], **TIGHT)
    torch.testing.assert_close(flash(case, pool)[nd:].double(), want[nd:], **TIGHT)
