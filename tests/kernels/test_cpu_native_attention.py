"""The C decode-attention kernel (kernels/cpu_native.py) against the float64 reference, and its
build: cached per machine, and absent (torch path) when there is no compiler."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve import kernels
from pdserve.env import reload as reload_env
from pdserve.kernels import cpu_native
from tests.kernels.test_torch_attention import MIXED, SHAPES, make_case, reference, run_torch

REPO = Path(__file__).resolve().parents[2]
HAVE_CC = bool(os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc"))


def native_decode(case) -> torch.Tensor:
    nd = case.meta.num_decode_seqs
    out = torch.full_like(case.query[:nd], float("nan"))
    assert cpu_native.paged_decode_attention(
        case.query[:nd], case.kv_layer, case.meta.block_tables, case.meta.context_lens, case.scale, out
    )
    return out


def test_builds_where_there_is_a_compiler():
    assert cpu_native.available() == HAVE_CC


needs_kernel = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: the kernel is not built")


@needs_kernel
@pytest.mark.parametrize("bs", [16, 4])
@pytest.mark.parametrize("hq,hkv,d", SHAPES)
def test_decode_matches_reference(bs, hq, hkv, d):
    """Shuffled block tables, lengths on and off block edges, garbage in unused slots."""
    ctx = (1, 5, 16, 17, 64, 3, 100)
    case = make_case([(1, c) for c in ctx], len(ctx), hq, hkv, d, bs, seed=bs * hq + d)
    torch.testing.assert_close(native_decode(case).double(), reference(case), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("bs", [16, 4])
@pytest.mark.parametrize("hq,hkv,d", SHAPES)
def test_bf16_decode_matches_reference(bs, hq, hkv, d):
    """bf16 queries, pool and output: K and V widened to fp32 as they are read, fp32 arithmetic,
    each output rounded once: within bf16 rounding of the float64 result on the same bf16 inputs."""
    ctx = (1, 5, 16, 17, 64, 3, 100)
    case = make_case([(1, c) for c in ctx], len(ctx), hq, hkv, d, bs, seed=bs * hq + d + 1)
    as_bf16 = dataclasses.replace(  # the inputs as bf16 holds them, for the reference
        case,
        query=case.query.bfloat16().float(),
        kv_layer=case.kv_layer.bfloat16().float(),
        hist_k=[h.bfloat16().float() for h in case.hist_k],
        hist_v=[h.bfloat16().float() for h in case.hist_v],
    )
    nd = case.meta.num_decode_seqs
    out = torch.full((nd, hq, d), float("nan"), dtype=torch.bfloat16)
    assert cpu_native.paged_decode_attention(
        case.query[:nd].bfloat16(),
        case.kv_layer.bfloat16(),
        case.meta.block_tables,
        case.meta.context_lens,
        case.scale,
        out,
    )
    torch.testing.assert_close(out.double(), reference(as_bf16), atol=1e-3, rtol=2**-8)


@needs_kernel
def test_query_rows_apart_as_in_the_fused_qkv():
    """The model hands over q as a view of its qkv projection ([n, Hq, D] rows Hq + 2Hkv heads
    apart): read in place, same result as contiguous rows."""
    case = make_case([(1, c) for c in (9, 40, 17)], 3, 8, 2, 64, 16, seed=24)
    nd = case.meta.num_decode_seqs
    fused = torch.randn(nd, 8 + 2 * 2, 64)
    fused[:, :8] = case.query[:nd]
    strided = fused[:, :8]
    assert not strided.is_contiguous()
    out = torch.full_like(case.query[:nd], float("nan"))
    assert cpu_native.paged_decode_attention(
        strided, case.kv_layer, case.meta.block_tables, case.meta.context_lens, case.scale, out
    )
    assert torch.equal(out, native_decode(case))


@needs_kernel
def test_mixed_batch_through_dispatch(monkeypatch):
    """kernels.paged_attention on the CPU: decodes through the decode kernel (prefill chunks
    through theirs: test_cpu_prefill_attention.py), one output."""
    monkeypatch.delenv("PDSERVE_ATTENTION", raising=False)
    reload_env()
    calls = []
    real = cpu_native.paged_decode_attention
    monkeypatch.setattr(cpu_native, "paged_decode_attention", lambda *a: calls.append(a) or real(*a))
    case = make_case(MIXED, 3, 8, 2, 64, 16, seed=21)
    out = kernels.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), reference(case), atol=1e-5, rtol=1e-5)
    monkeypatch.setenv("PDSERVE_ATTENTION", "torch")  # the pure-torch reference path
    reload_env()
    out = kernels.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)
    assert len(calls) == 1 and torch.equal(out, run_torch(case))


@needs_kernel
@pytest.mark.parametrize("ctx", [(40, 7, 90, 33, 1), (70,), (1000,), (700, 3, 129)])
def test_threads_split_the_work_identically(ctx):
    """Whole sequences per work item, or spans of a long context (a small batch) merged in span
    order: the same bits at any thread count."""
    case = make_case([(1, c) for c in ctx], len(ctx), 8, 4, 32, 16, seed=22)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_decode(case)
        torch.set_num_threads(3)  # more threads than cores is allowed, just slower
        many = native_decode(case)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, many)
    torch.testing.assert_close(one.double(), reference(case), atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d", [(40, 1, 16), (4, 2, 20)])
def test_shapes_over_the_limits_fall_back_to_torch(hq, hkv, d):
    """More than 32 query heads per KV head, or a head_dim not a multiple of 8: the kernel
    refuses, dispatch still answers."""
    case = make_case([(1, 9), (1, 20)], 2, hq, hkv, d, 16, seed=23)
    out = torch.empty_like(case.query)
    assert not cpu_native.paged_decode_attention(
        case.query, case.kv_layer, case.meta.block_tables, case.meta.context_lens, case.scale, out
    )
    res = kernels.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)
    torch.testing.assert_close(res.double(), reference(case), atol=1e-5, rtol=1e-5)


def _fresh_interpreter(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "PDSERVE_ATTENTION"} | env
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=full, capture_output=True, text=True, timeout=180)


@needs_kernel
def test_built_once_into_the_cache(tmp_path):
    code = "from kernels import cpu_native; assert cpu_native.available()"
    for _ in range(2):
        proc = _fresh_interpreter(code, XDG_CACHE_HOME=str(tmp_path))
        assert proc.returncode == 0, proc.stderr[-2000:]
    built = list((tmp_path / "pdserve" / "kernels").glob("cpu_decode_attention-*.so"))
    assert len(built) == 1


def test_no_compiler_means_torch_path(tmp_path):
    code = (
        "import torch, kernels\n"
        "from kernels import cpu_native\n"
        "assert not cpu_native.available() and not cpu_native.gemv_available()\n"
        "assert not cpu_native.prefill_available()\n"
        "meta = kernels.AttentionMetadata.build([1, 2], [3, 2], [[1], [0]], 1)\n"
        "kv = torch.randn(2, 2, 4, 1, 8)\n"
        "k = torch.randn(3, 1, 8)\n"
        "kernels.store_kv(k, k, kv, torch.tensor([2, 0, 1]))\n"
        "out = kernels.paged_attention(torch.randn(3, 2, 8), k, k, kv, meta, 0.35)\n"
        "assert out.shape == (3, 2, 8) and bool(out.isfinite().all())\n"
    )
    proc = _fresh_interpreter(code, CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch twin runs instead" in proc.stderr
