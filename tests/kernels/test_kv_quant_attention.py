"""Attention over a quantized KV pool (--kv-cache-dtype int8|fp8, kernels/kv_quant.py): the C
decode and flash prefill kernels and the torch path, each against the float64 reference on the
dequantized values (so the tolerance is float rounding's, not quantization's); the C store's bytes
against torch's quantize; fp8's C conversions (e4m3 -> fp32 in the kernels, fp32 -> e4m3 in the
store) bit for bit against torch's; every ISA build this CPU can run."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from pdserve import kernels
from pdserve.env import reload as reload_env
from pdserve.kernels import cpu_native, kv_quant, layer_ops, torch_attention
from pdserve.kernels.kv_quant import FP8, INT8, RowFormat
from tests.kernels.isa_builds import ISAS, isa_variant
from tests.kernels.test_torch_attention import MIXED, SHAPES, Case, make_case, reference

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the kernels are not built")
FLASH = cpu_native.FLASH_SOURCE
TIGHT = dict(atol=2e-5, rtol=1e-5)
DECODE_ENTRY = {INT8: "paged_decode_attention_q8", FP8: "paged_decode_attention_f8"}
FLASH_ENTRY = {INT8: "prefill_flash_q8", FP8: "prefill_flash_f8"}


@pytest.fixture(params=[INT8, FP8], ids=lambda f: f.kv_cache_dtype)
def fmt(request) -> RowFormat:
    return request.param


def quantized(case: Case, fmt: RowFormat) -> tuple[torch.Tensor, Case]:
    """The case's pool as `fmt` rows [2, N, bs, Hkv, D + 4], and the case as those rows give it back
    (pool, history and this step's K/V dequantized): what the quantized kernels must match."""
    pool = kv_quant.quantize(case.kv_layer, fmt)  # [2, N, bs, Hkv, D + 4]
    back = dataclasses.replace(
        case,
        kv_layer=kv_quant.dequantize(pool),
        key=kv_quant.roundtrip(case.key, fmt),
        value=kv_quant.roundtrip(case.value, fmt),
        hist_k=[kv_quant.roundtrip(h, fmt) for h in case.hist_k],
        hist_v=[kv_quant.roundtrip(h, fmt) for h in case.hist_v],
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


def test_quantize_int8_rows():
    """scale = max|x| / 127 after the values; round half to even; a zero row stays zero."""
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -127.0, 3.0, 0.0], [0.0] * 8])
    rows = kv_quant.quantize(x, INT8)
    assert rows.shape == (2, 12) and rows.dtype == torch.int8
    assert rows[0, :8].tolist() == [127, 0, 2, 2, 0, -127, 3, 0]
    assert kv_quant.scales(rows).tolist() == [1.0, 0.0]
    assert torch.equal(kv_quant.dequantize(rows[1:]), torch.zeros(1, 8))
    y = torch.randn(50, 64) * 7
    err = (kv_quant.roundtrip(y, INT8) - y).abs()
    assert bool((err <= y.abs().amax(-1, keepdim=True) / 254 * (1 + 1e-6)).all())  # half a step at most


def test_quantize_fp8_rows():
    """scale = max|x| / 448 after the values, in a uint8 pool; e4m3 rounded to nearest even
    (subnormals too); a zero row stays zero; -0 keeps its sign bit."""
    x = torch.tensor([[448.0, 1.0, 1.0625, 1.1875, -(2**-10), 3 * 2**-10, -0.0, 0.0], [0.0] * 8])
    rows = kv_quant.quantize(x, FP8)
    assert rows.shape == (2, 12) and rows.dtype == torch.uint8
    # 448 = 0.1111.110; 1.0625 ties to 1.0 (even), 1.1875 to 1.25; 2^-10 ties to 0, 3 * 2^-10 to 2 * 2^-9
    assert rows[0, :8].tolist() == [0x7E, 0x38, 0x38, 0x3A, 0x80, 0x02, 0x80, 0x00]
    assert kv_quant.scales(rows).tolist() == [1.0, 0.0]
    assert kv_quant.dequantize(rows[:1]).tolist() == [[448.0, 1.0, 1.0, 1.25, -0.0, 2**-8, -0.0, 0.0]]
    assert torch.equal(kv_quant.dequantize(rows[1:]), torch.zeros(1, 8))
    y = torch.randn(50, 64) * 7
    scale = y.abs().amax(-1, keepdim=True) / 448
    err = (kv_quant.roundtrip(y, FP8) - y).abs()
    # half a step: 2^-4 of |y| for a normal, 2^-10 of the scale (half the least subnormal) below
    assert bool((err <= torch.maximum(y.abs() / 16, scale / 1024) * (1 + 1e-6)).all())


def every_float_near_e4m3() -> torch.Tensor:
    """fp32 values for the conversion's test: every top-16-bit pattern (all exponents and signs,
    the 7 mantissa bits that decide e4m3's rounding: every tie, subnormal and the +-448 edge, +-inf),
    each with low bits 0 (exact ties), 1 (just past), 0x7fff / 0x8000 / 0xffff and a random few."""
    g = torch.Generator().manual_seed(0)
    high = torch.arange(1 << 16, dtype=torch.int64) << 16  # [65536]
    low = torch.cat(
        [torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF]), torch.randint(0, 1 << 16, (6,), generator=g)]
    )
    bits = (high[:, None] | low[None, :]).reshape(-1)  # [65536 * 12] as unsigned 32-bit values
    x = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)
    return x[~torch.isnan(x)]


def test_c_fp8_conversion_is_torchs_bit_for_bit():
    """f8_from_f32 (the C store's) against x.clamp(-448, 448).to(torch.float8_e4m3fn)."""
    if not layer_ops.native_available():
        pytest.skip("layer ops not built")
    x = every_float_near_e4m3()
    want = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    got = layer_ops.f8_from_f32(x)
    bad = (got != want).nonzero()[:5, 0]
    assert not len(bad), list(zip(x[bad].tolist(), got[bad].tolist(), want[bad].tolist()))


def every_e4m3_code() -> tuple[Case, torch.Tensor, torch.Tensor]:
    """A decode case over an fp8 pool whose one sequence has one token, its V rows (2 heads of 128)
    holding every e4m3 code but NaN's (never stored: the store saturates) with scale 1: attention
    over one key returns its V row, exactly. (case, pool, the values torch reads those codes as)."""
    case = make_case([(1, 1)], 1, 2, 2, 128, 16, seed=1)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[[0x7F, 0xFF]] = 0x00
    pool = kv_quant.quantize(case.kv_layer, FP8)  # [2, N, bs, 2, 128 + 4]
    block = case.meta.block_tables[0, 0]
    pool[1, block, 0, :, :128] = codes.view(2, 128)
    pool[1, block, 0, :, 128:] = torch.ones(2, 1).view(torch.uint8)  # scale 1.0
    return case, pool, codes.view(torch.float8_e4m3fn).float().view(1, 2, 128)  # [1, Hq, D]


def test_decode_widens_every_e4m3_code_exactly():
    """f8_widen8: normals, subnormals and zeros, as torch's float8_e4m3fn values (equal as floats:
    attention cannot show a zero's sign, its sums start at +0)."""
    case, pool, want = every_e4m3_code()
    assert torch.equal(decode(case, pool), want)


def test_c_store_writes_torch_quantize_bytes(fmt):
    """The fused rotary + store (rope_store_q8 / rope_store_f8) leaves the same pool bytes as torch's store."""
    if not layer_ops.native_available():
        pytest.skip("layer ops not built")
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, n, bs = 8, 2, 64, 6, 4
    qkv = torch.randn(9, (hq + 2 * hkv) * d, generator=g) * 3
    qkv[0, (hq + hkv) * d : (hq + hkv) * d + 4] = torch.tensor([127.0, -63.5, 0.5, 1.5])  # int8 V ties
    qkv[1, (hq + hkv) * d : (hq + hkv) * d + 4] = torch.tensor([448.0, 1.0625, 1.1875, 3 * 2**-10])  # e4m3 V ties
    cos, sin = torch.randn(9, 1, d, generator=g), torch.randn(9, 1, d, generator=g)
    slots = torch.tensor([0, 5, 3, -1, 7, 8, 23, 1, 2])
    pool = torch.zeros(2, n, bs, hkv, d + 4, dtype=fmt.pool_dtype)
    fused = layer_ops.rope_store(qkv, cos, sin, hq, hkv, pool, slots)
    assert fused is not None
    _, k, v = fused
    want = torch.zeros_like(pool)
    torch_attention.store_kv(k, v, want, slots)
    assert torch.equal(pool, want)


@pytest.mark.parametrize("bs", [16, 4])
@pytest.mark.parametrize("hq,hkv,d", SHAPES + [(8, 1, 128)])
def test_decode_matches_reference_on_dequantized_values(fmt, bs, hq, hkv, d):
    ctx = (1, 5, 16, 17, 64, 3, 100)
    case = make_case([(1, c) for c in ctx], len(ctx), hq, hkv, d, bs, seed=bs * hq + d)
    pool, back = quantized(case, fmt)
    torch.testing.assert_close(decode(case, pool).double(), reference(back), **TIGHT)


@pytest.mark.parametrize("window,softcap", [(7, None), (None, 5.0), (20, 3.0)])
def test_decode_window_and_softcap_as_over_the_fp32_pool(fmt, window, softcap):
    """Same as the fp32 kernel (itself checked against references) on the dequantized pool."""
    ctx = (1, 9, 16, 40, 70)
    case = make_case([(1, c) for c in ctx], len(ctx), 8, 2, 64, 16, seed=5)
    pool, back = quantized(case, fmt)
    want = decode(back, back.kv_layer, window=window, softcap=softcap)
    torch.testing.assert_close(decode(case, pool, window=window, softcap=softcap), want, **TIGHT)


def test_decode_row_does_not_depend_on_the_batch_or_threads(fmt):
    """A sequence alone, or among others, or on one thread: its output within float rounding of the
    batch's (work spans follow the batch's context, so sums may split differently), and on any
    thread count the same bits."""
    ctx = (3, 100, 17, 250, 64)
    case = make_case([(1, c) for c in ctx], len(ctx), 8, 2, 64, 16, seed=9)
    pool, _ = quantized(case, fmt)
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
def test_flash_prefill_matches_reference_on_dequantized_values(fmt, bs, hq, hkv, d):
    if d % 16 and "avx512f" in open("/proc/cpuinfo").read():
        pytest.skip("head_dim off the AVX-512 vector: the flash kernel refuses it")
    case = make_case(MIXED, 3, hq, hkv, d, bs, seed=bs + hq + d)
    pool, back = quantized(case, fmt)
    nd = case.meta.num_decode_seqs
    torch.testing.assert_close(flash(case, pool)[nd:].double(), reference(back)[nd:], **TIGHT)


@pytest.mark.parametrize("window,softcap", [(9, None), (None, 4.0), (30, 2.0)])
def test_flash_window_and_softcap_as_over_the_fp32_pool(fmt, window, softcap):
    case = make_case([(40, 40), (9, 50), (33, 70)], 0, 8, 2, 64, 16, seed=6)
    pool, back = quantized(case, fmt)
    want = flash(back, back.kv_layer, window=window, softcap=softcap)
    torch.testing.assert_close(flash(case, pool, window=window, softcap=softcap), want, **TIGHT)


def test_flash_row_does_not_depend_on_the_batch(fmt):
    """Each (sequence, KV head, query tile) is one work item: a sequence alone, the same bits."""
    case = make_case([(40, 40), (9, 50), (33, 70)], 0, 8, 2, 64, 16, seed=12)
    pool, _ = quantized(case, fmt)
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


def test_torch_path_matches_reference_on_dequantized_values(fmt, monkeypatch):
    """PDSERVE_ATTENTION=torch: the store quantizes, gathers dequantize, whole-prompt chunks attend
    over their K/V as the pool holds them (a mixed batch: decodes, chunks with context, whole prompts)."""
    monkeypatch.setenv("PDSERVE_ATTENTION", "torch")
    reload_env()
    case = make_case(MIXED, 3, 8, 2, 32, 4, seed=13)
    pool, back = quantized(case, fmt)
    out = kernels.paged_attention(case.query, case.key, case.value, pool, case.meta, case.scale)
    torch.testing.assert_close(out.double(), reference(back), **TIGHT)


def test_dispatch_reads_quantized_rows_in_the_c_kernels(fmt, monkeypatch):
    monkeypatch.delenv("PDSERVE_ATTENTION", raising=False)
    reload_env()
    used = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, _r=real, _n=name, **kw: used.append(_n) or _r(*a, **kw))
    case = make_case(MIXED, 3, 8, 2, 64, 16, seed=14)
    pool, back = quantized(case, fmt)
    out = kernels.paged_attention(case.query, case.key, case.value, pool, case.meta, case.scale)
    assert used == ["paged_decode_attention", "paged_prefill_attention"]
    torch.testing.assert_close(out.double(), reference(back), **TIGHT)


@pytest.fixture(scope="module", params=list(ISAS))
def isa_builds(request, tmp_path_factory):
    """The decode, flash and layer-ops kernels built for one ISA level, typed as the machine's own."""
    out = tmp_path_factory.mktemp(request.param)
    dec = isa_variant(request.param, cpu_native.ATTENTION_SOURCE, out, cpu_native._library(), *DECODE_ENTRY.values())
    fl = isa_variant(request.param, FLASH, out, cpu_native._prefill_library(FLASH), *FLASH_ENTRY.values())
    ops = isa_variant(request.param, layer_ops.SOURCE, out, layer_ops._library(), "f8_from_f32_n")
    return dec, fl, ops


def test_every_isa_build_reads_quantized_rows_right(isa_builds, fmt, monkeypatch):
    """Plain SSE2, AVX2 and AVX-512 builds (those this CPU runs) of both kernels: the reference."""
    dec, fl, _ = isa_builds
    monkeypatch.setattr(cpu_native, "_library", lambda: dec)
    monkeypatch.setattr(cpu_native, "_prefill_library", lambda source=FLASH: fl)
    case = make_case(MIXED, 3, 8, 2, 64, 16, seed=15)
    pool, back = quantized(case, fmt)
    nd = case.meta.num_decode_seqs
    want = reference(back)
    torch.testing.assert_close(decode(case, pool).double(), want[:nd], **TIGHT)
    torch.testing.assert_close(flash(case, pool)[nd:].double(), want[nd:], **TIGHT)


def test_every_isa_build_converts_fp8_exactly(isa_builds, monkeypatch):
    """Each level's e4m3 -> fp32 (decode) and fp32 -> e4m3 (store) conversions: torch's bits."""
    dec, _, ops = isa_builds
    monkeypatch.setattr(cpu_native, "_library", lambda: dec)
    monkeypatch.setattr(layer_ops, "_library", lambda: ops)
    case, pool, want = every_e4m3_code()
    assert torch.equal(decode(case, pool), want)
    x = every_float_near_e4m3()
    assert torch.equal(layer_ops.f8_from_f32(x), x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))
