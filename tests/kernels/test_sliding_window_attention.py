"""Per-layer sliding window and logit soft-capping in paged attention (kernels.paged_attention):
the torch path and the three C kernels (decode, flash prefill, tiled prefill) against a float64
reference, on ragged batches of decodes and chunks whose context crosses the window, over
shuffled block tables with garbage in unused slots (a key read outside the window shows)."""

from __future__ import annotations

import pytest
import torch

from pdserve.kernels import cpu_native, torch_attention
from tests.kernels.test_cpu_native_attention import HAVE_CC
from tests.kernels.test_torch_attention import Case, make_case

# (q_len, context): 3 decodes (context inside, at, and past the window), then prefill chunks:
# a whole prompt longer than the window, chunks after earlier context crossing it, a short one.
SEQS = [(1, 9), (1, 20), (1, 77), (70, 70), (25, 90), (40, 41), (3, 3)]
NUM_DECODE = 3


def reference(case: Case, window: int | None, softcap: float | None) -> torch.Tensor:
    """Dense attention one query at a time, float64: the query at position p sees keys j with
    p - window < j <= p; scores s -> tanh(s / softcap) * softcap before the softmax."""
    hq = case.query.shape[1]
    rows, t = [], 0
    for q_len, hk, hv in zip(case.q_lens, case.hist_k, case.hist_v):
        c, groups = hk.shape[0], hq // hk.shape[1]
        for i in range(q_len):
            pos = c - q_len + i
            lo = max(0, pos - window + 1) if window else 0
            k = hk[lo : pos + 1].double().repeat_interleave(groups, dim=1)  # [S, Hq, D]
            v = hv[lo : pos + 1].double().repeat_interleave(groups, dim=1)  # [S, Hq, D]
            s = torch.einsum("hd,shd->hs", case.query[t].double(), k) * case.scale  # [Hq, S]
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            rows.append(torch.einsum("hs,shd->hd", s.softmax(-1), v))
            t += 1
    return torch.stack(rows)  # [T, Hq, D]


def run_torch(case: Case, window: int | None, softcap: float | None) -> torch.Tensor:
    out = torch.full_like(case.query, float("nan"))
    torch_attention.attend_decodes(case.query, case.kv_layer, case.meta, case.scale, out, window, softcap)
    torch_attention.attend_prefills(
        case.query, case.key, case.value, case.kv_layer, case.meta, case.scale, out, window, softcap
    )
    return out


OPTIONS = [(32, None), (16, None), (32, 2.0), (None, 2.0), (None, None)]


@pytest.mark.parametrize("window,softcap", OPTIONS)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 6)])
def test_torch_path_matches_the_reference(window, softcap, hq, hkv):
    case = make_case(SEQS, NUM_DECODE, hq, hkv, 32, 16, seed=hq + (window or 0), runs=(4,))
    want = reference(case, window, softcap)
    torch.testing.assert_close(run_torch(case, window, softcap).double(), want, atol=1e-5, rtol=1e-5)


def test_the_window_changes_the_output():
    """The test above would pass with the window ignored only if the window hid nothing."""
    case = make_case(SEQS, NUM_DECODE, 4, 2, 32, 16, seed=1)
    assert not torch.allclose(run_torch(case, 16, None), run_torch(case, None, None))
    assert not torch.allclose(run_torch(case, None, 2.0), run_torch(case, None, None))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the kernels are not built")
@pytest.mark.parametrize("window,softcap", OPTIONS)
@pytest.mark.parametrize("d", [32, 64])
def test_c_kernels_match_the_reference(window, softcap, d):
    case = make_case(SEQS, NUM_DECODE, 8, 2, d, 16, seed=d + (window or 0))
    want = reference(case, window, softcap)
    m, nd = case.meta, NUM_DECODE
    out = torch.full_like(case.query, float("nan"))
    assert cpu_native.paged_decode_attention(
        case.query[:nd], case.kv_layer, m.block_tables, m.context_lens, case.scale, out[:nd], window, softcap
    )
    torch.testing.assert_close(out[:nd].double(), want[:nd], atol=1e-5, rtol=1e-5)
    for source in (cpu_native.FLASH_SOURCE, cpu_native.PREFILL_SOURCE):
        out = torch.full_like(case.query, float("nan"))
        assert cpu_native.paged_prefill_attention(
            case.query, case.kv_layer, m.block_tables, m.cu_seqlens_q, m.context_lens, nd, case.scale, out, source,
            window, softcap,
        )  # fmt: skip
        torch.testing.assert_close(out[nd:].double(), want[nd:], atol=1e-5, rtol=1e-5, msg=source.name)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the kernels are not built")
def test_c_kernels_skip_the_blocks_before_the_window():
    """Blocks wholly before every query's window hold NaN: the kernels must never read them."""
    case = make_case([(1, 100), (20, 100)], 1, 4, 2, 32, 16, seed=5)
    want = reference(case, 32, None)
    for b, first_seen in ((0, 100 - 32), (1, 100 - 20 - 32 + 1)):
        for blk in case.meta.block_tables[b, : first_seen // 16].tolist():
            case.kv_layer[:, blk] = float("nan")
    m = case.meta
    out = torch.full_like(case.query, float("nan"))
    assert cpu_native.paged_decode_attention(
        case.query[:1], case.kv_layer, m.block_tables, m.context_lens, case.scale, out[:1], 32
    )
    for source in (cpu_native.FLASH_SOURCE, cpu_native.PREFILL_SOURCE):
        assert cpu_native.paged_prefill_attention(
            case.query, case.kv_layer, m.block_tables, m.cu_seqlens_q, m.context_lens, 1, case.scale, out, source, 32
        )
        torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(run_torch(case, 32, None).double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the kernels are not built")
@pytest.mark.parametrize("window,softcap", [(32, None), (16, 2.0)])
def test_flash_bf16_takes_the_window_and_softcap(window, softcap):
    case = make_case(SEQS, NUM_DECODE, 8, 2, 64, 16, dtype=torch.bfloat16, seed=3)
    m, nd = case.meta, NUM_DECODE
    out = torch.full_like(case.query, float("nan"))
    assert cpu_native.paged_prefill_attention(
        case.query, case.kv_layer, m.block_tables, m.cu_seqlens_q, m.context_lens, nd, case.scale, out,
        cpu_native.FLASH_SOURCE, window, softcap,
    )  # fmt: skip
    want = reference(case, window, softcap)[nd:]
    torch.testing.assert_close(out[nd:].double(), want, atol=2e-2, rtol=2**-7)
    assert (out[nd:].double() - reference(case, None, None)[nd:]).abs().max() > 0.1  # the options took effect
