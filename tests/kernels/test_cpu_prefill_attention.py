"""The C prefill-attention kernel (kernels/cpu_prefill_attention.c) against the float64
reference: prompt chunks with and without earlier context, behind decodes, on shuffled blocks
with garbage in the unused slots."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.env import reload as reload_env
from pdserve.kernels import cpu_native
from tests.kernels.test_cpu_native_attention import HAVE_CC
from tests.kernels.test_torch_attention import MIXED, SHAPES, make_case, reference

pytestmark = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the kernel is not built")

# (q_len, context): whole prompts, chunks after earlier context, a lone token at position 0,
# lengths on and off the 16-key tiles and the 16-position query tiles.
CHUNKS = [(1, 1), (16, 16), (17, 17), (40, 40), (7, 40), (33, 70), (5, 37), (100, 100), (31, 95)]


def native_prefill(case) -> torch.Tensor:
    """The kernel's rows for the prefill sequences; decode rows are left NaN."""
    out = torch.full_like(case.query, float("nan"))
    meta = case.meta
    assert cpu_native.paged_prefill_attention(
        case.query,
        case.kv_layer,
        meta.block_tables,
        meta.cu_seqlens_q,
        meta.context_lens,
        meta.num_decode_seqs,
        case.scale,
        out,
    )
    return out


def prefill_rows(case, t: torch.Tensor) -> torch.Tensor:
    return t[case.meta.cu_seqlens_q_cpu[case.meta.num_decode_seqs] :]


def test_builds_where_there_is_a_compiler():
    assert cpu_native.prefill_available()


@pytest.mark.parametrize("bs", [16, 4, 32])
@pytest.mark.parametrize("hq,hkv,d", SHAPES + [(14, 2, 64), (4, 1, 128), (6, 2, 248)])
def test_matches_reference(bs, hq, hkv, d):
    """Block sizes under, at and over the 16-key tile; GQA groups of 1-7; head_dim 16-248 (the
    last shrinks the query tile so its padded rows fit the item's buffers)."""
    case = make_case(CHUNKS, 0, hq, hkv, d, bs, seed=bs * hq + d, runs=(2,))
    torch.testing.assert_close(native_prefill(case).double(), reference(case), atol=1e-5, rtol=1e-5)


def test_leaves_the_decode_rows_alone():
    case = make_case(MIXED, 3, 8, 2, 64, 16, seed=31)
    out = native_prefill(case)
    nd = case.meta.num_decode_seqs
    assert bool(out[:nd].isnan().all())
    torch.testing.assert_close(
        prefill_rows(case, out).double(), prefill_rows(case, reference(case)), atol=1e-5, rtol=1e-5
    )


def test_query_rows_apart_as_in_the_fused_qkv():
    case = make_case([(20, 20), (9, 30)], 0, 8, 2, 64, 16, seed=32)
    fused = torch.randn(case.query.shape[0], 8 + 2 * 2, 64)
    fused[:, :8] = case.query
    strided = fused[:, :8]
    assert not strided.is_contiguous()
    out = torch.full_like(case.query, float("nan"))
    meta = case.meta
    assert cpu_native.paged_prefill_attention(
        strided, case.kv_layer, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, 0, case.scale, out
    )
    assert torch.equal(out, native_prefill(case))


def test_same_bits_at_any_thread_count():
    """Each (sequence, KV head, query tile) is computed whole by one thread."""
    case = make_case([(70, 70), (30, 90), (3, 3)], 0, 8, 4, 32, 16, seed=33)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_prefill(case)
        torch.set_num_threads(3)
        many = native_prefill(case)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)


def test_dispatch_sends_decodes_and_prefills_to_their_kernels(monkeypatch):
    monkeypatch.delenv("PDSERVE_ATTENTION", raising=False)
    reload_env()
    calls = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        real = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name, lambda *a, _n=name, _r=real, **kw: calls.append(_n) or _r(*a, **kw))
    case = make_case(MIXED, 3, 8, 2, 64, 16, seed=34)
    out = kernels.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)
    assert calls == ["paged_decode_attention", "paged_prefill_attention"]
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,d", [(40, 1, 16), (4, 2, 20)])
def test_shapes_over_the_limits_fall_back_to_torch(hq, hkv, d):
    """More than 16 query heads per KV head, or a head_dim not a multiple of 8."""
    case = make_case([(9, 9), (5, 20)], 0, hq, hkv, d, 16, seed=35)
    meta = case.meta
    assert not cpu_native.paged_prefill_attention(
        case.query,
        case.kv_layer,
        meta.block_tables,
        meta.cu_seqlens_q,
        meta.context_lens,
        0,
        case.scale,
        torch.empty_like(case.query),
    )
    res = kernels.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)
    torch.testing.assert_close(res.double(), reference(case), atol=1e-5, rtol=1e-5)
