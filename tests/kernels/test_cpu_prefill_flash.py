"""The flash prefill-attention kernel (kernels/cpu_prefill_flash.c) against the float64 reference
and the pure-torch path: random ragged batches of whole prompts and chunks after earlier context,
on shuffled (non-contiguous) block tables with garbage in the unused slots."""

from __future__ import annotations

import ctypes
import random

import pytest
import torch

from pdserve import kernels
from pdserve.env import reload as reload_env
from pdserve.kernels import attention, cpu_native
from tests.kernels.isa_builds import build, cannot_run
from tests.kernels.test_cpu_native_attention import HAVE_CC
from tests.kernels.test_torch_attention import MIXED, make_case, reference, run_torch

pytestmark = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the kernel is not built")
FLASH = cpu_native.FLASH_SOURCE


def random_batch(seed: int) -> list[tuple[int, int]]:
    """(q_len, context) of 2-5 sequences: whole prompts and chunks after earlier context, on and
    off the 32-key tiles and the 32-position query tiles, one long enough for several of each."""
    rng = random.Random(seed)
    seqs = [(rng.randint(65, 140), 0)]
    for _ in range(rng.randint(1, 4)):
        seqs.append((rng.randint(1, 70), rng.choice([0, rng.randint(1, 90)])))
    return [(q, q + past) for q, past in seqs]


def flash(case, first: int = 0) -> torch.Tensor:
    """The kernel's rows for sequences `first..`; the rows before are left NaN."""
    out = torch.full_like(case.query, float("nan"))
    m = case.meta
    ok = cpu_native.paged_prefill_attention(
        case.query, case.kv_layer, m.block_tables, m.cu_seqlens_q, m.context_lens, first, case.scale, out, FLASH
    )
    assert ok, "the flash kernel refused a shape it takes"
    return out


def test_builds_where_there_is_a_compiler():
    assert cpu_native.prefill_available(FLASH)


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (9, 3), (8, 2)])  # GQA ratios 1, 3, 4
def test_random_ragged_chunked_batches_match_the_reference(hq, hkv, d, bs):
    seed = hq * 1000 + d * 10 + bs
    case = make_case(random_batch(seed), 0, hq, hkv, d, bs, seed=seed)
    out = flash(case)
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, run_torch(case), atol=1e-5, rtol=1e-5)


def test_long_chunk_after_long_context():
    """Many full (unmasked) key tiles before the diagonal ones, several query tiles."""
    case = make_case([(200, 520), (130, 130)], 0, 9, 3, 64, 16, seed=7)
    torch.testing.assert_close(flash(case).double(), reference(case), atol=1e-5, rtol=1e-5)


def test_leaves_the_decode_rows_alone():
    case = make_case(MIXED, 3, 8, 2, 64, 16, seed=31)
    nd = case.meta.num_decode_seqs
    out = flash(case, first=nd)
    assert bool(out[:nd].isnan().all())
    torch.testing.assert_close(out[nd:].double(), reference(case)[nd:], atol=1e-5, rtol=1e-5)


def test_query_rows_apart_as_in_the_fused_qkv():
    case = make_case([(40, 40), (9, 50)], 0, 8, 2, 64, 16, seed=32)
    fused = torch.randn(case.query.shape[0], 8 + 2 * 2, 64)
    fused[:, :8] = case.query
    strided = fused[:, :8]
    assert not strided.is_contiguous()
    out = torch.full_like(case.query, float("nan"))
    m = case.meta
    assert cpu_native.paged_prefill_attention(
        strided, case.kv_layer, m.block_tables, m.cu_seqlens_q, m.context_lens, 0, case.scale, out, FLASH
    )
    assert torch.equal(out, flash(case))


def test_same_bits_at_any_thread_count():
    """Each (sequence, KV head, query tile) is computed whole by one thread."""
    case = make_case([(70, 70), (30, 90), (3, 3)], 0, 8, 4, 64, 16, seed=33)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = flash(case)
        torch.set_num_threads(3)
        many = flash(case)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_dispatch_sends_prefills_to_the_flash_kernel(monkeypatch):
    monkeypatch.delenv("PDSERVE_ATTENTION", raising=False)
    reload_env()
    used = []
    real = cpu_native.paged_prefill_attention
    monkeypatch.setattr(cpu_native, "paged_prefill_attention", lambda *a, **kw: used.append(a[-1]) or real(*a, **kw))
    case = make_case(MIXED, 3, 9, 3, 64, 16, seed=34)
    out = kernels.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)
    assert used == [FLASH]
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)


def test_head_dim_off_the_vector_width_goes_to_the_next_kernel(monkeypatch):
    """head_dim 24: not a multiple of the AVX-512 vector (16 floats). Where the flash kernel refuses
    it the tiled kernel runs; the result is right either way."""
    monkeypatch.delenv("PDSERVE_ATTENTION", raising=False)
    reload_env()
    case = make_case([(40, 40), (9, 30)], 0, 4, 2, 24, 16, seed=35)
    m = case.meta
    takes = cpu_native.paged_prefill_attention(
        case.query, case.kv_layer, m.block_tables, m.cu_seqlens_q, m.context_lens, 0, case.scale,
        torch.empty_like(case.query), FLASH,
    )  # fmt: skip
    used = []
    real = cpu_native.paged_prefill_attention
    monkeypatch.setattr(cpu_native, "paged_prefill_attention", lambda *a, **kw: used.append(a[-1]) or real(*a, **kw))
    out = kernels.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)
    assert used == ([FLASH] if takes else list(attention.CPU_PREFILL_KERNELS))
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,d,bs", [(9, 3, 64, 16), (8, 2, 128, 32), (2, 2, 64, 16)])
def test_bf16_pool_matches_the_reference(hq, hkv, d, bs):
    """bf16 queries, pool and output: fp32 arithmetic inside, so the error is the output's rounding
    (half a bf16 ulp, 2^-9 relative) plus fp32's; torch's bf16 path is held to the same bound."""
    seed = 7 * hq + d + bs
    case = make_case(random_batch(seed), 0, hq, hkv, d, bs, dtype=torch.bfloat16, seed=seed)
    out = flash(case)
    assert out.dtype == torch.bfloat16
    ref = reference(case)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=2**-8)
    torch.testing.assert_close(run_torch(case).double(), ref, atol=1e-2, rtol=2**-7)


def test_dispatch_sends_bf16_prefills_to_the_flash_kernel(monkeypatch):
    monkeypatch.delenv("PDSERVE_ATTENTION", raising=False)
    reload_env()
    used = []
    real = cpu_native.paged_prefill_attention
    monkeypatch.setattr(cpu_native, "paged_prefill_attention", lambda *a, **kw: used.append(a[-1]) or real(*a, **kw))
    case = make_case(MIXED, 3, 8, 2, 64, 16, dtype=torch.bfloat16, seed=36)
    out = kernels.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)
    assert used == [FLASH]
    nd = case.meta.num_decode_seqs
    torch.testing.assert_close(out[nd:].double(), reference(case)[nd:], atol=1e-5, rtol=2**-8)


def _entry(lib: ctypes.CDLL, name: str):
    fn = getattr(lib, name)
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64]
    fn.argtypes += (
        [ctypes.c_void_p] * 3 + [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_float, ctypes.c_int]
    )
    return fn


@pytest.mark.skipif(cannot_run("avx2") is not None, reason=str(cannot_run("avx2")))
def test_the_avx2_build_matches_the_reference(tmp_path):
    """The same source compiled without AVX-512 (8-float vectors, 4-key score tiles), as on a CPU
    that has only AVX2: right for fp32 and bf16, head_dim 24 (a multiple of 8 only) included."""
    lib = build(FLASH, "avx2", tmp_path)
    for dtype, name, rtol in (
        (torch.float32, "prefill_flash_f32", 1e-5),
        (torch.bfloat16, "prefill_flash_bf16", 2**-8),
    ):
        for hq, hkv, d in ((9, 3, 64), (8, 2, 128), (4, 2, 24)):
            seed = hq + d
            case = make_case(random_batch(seed), 0, hq, hkv, d, 16, dtype=dtype, seed=seed)
            out = torch.full_like(case.query, float("nan"))
            m, (_, nb, bs, _, _) = case.meta, case.kv_layer.shape
            rc = _entry(lib, name)(
                case.query.data_ptr(), case.query.stride(0), case.kv_layer.data_ptr(), nb * bs,
                m.block_tables.data_ptr(), m.block_tables.stride(0), m.cu_seqlens_q.data_ptr(),
                m.context_lens.data_ptr(), out.data_ptr(), 0, len(case.q_lens), hq, hkv, d, bs, case.scale, 0, 0.0, 1,
            )  # fmt: skip
            assert rc == 0
            torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=rtol)
