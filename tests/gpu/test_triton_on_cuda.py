"""Triton kernels compiled for a real CUDA device, against the torch path and the dense float64
reference (the same cases the interpreter test runs on CPU, plus fp16 and larger shapes).
Skipped without a CUDA device; run on the lent GPU machine (docs/benchmarks/gpu.md)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.env import reload as reload_env

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _on_cuda(case):
    """Move a tests.kernels Case (tensors, metadata) onto the GPU."""
    from pdserve.kernels import AttentionMetadata

    meta = case.meta
    cuda_meta = AttentionMetadata(
        cu_seqlens_q=meta.cu_seqlens_q.cuda(),
        context_lens=meta.context_lens.cuda(),
        block_tables=meta.block_tables.cuda(),
        num_decode_seqs=meta.num_decode_seqs,
        max_q_len=meta.max_q_len,
        max_context_len=meta.max_context_len,
        cu_seqlens_q_cpu=meta.cu_seqlens_q_cpu,
        context_lens_cpu=meta.context_lens_cpu,
    )
    return dataclasses.replace(
        case,
        query=case.query.cuda(),
        key=case.key.cuda(),
        value=case.value.cuda(),
        kv_layer=case.kv_layer.cuda(),
        meta=cuda_meta,
    )


def _cases():
    from tests.kernels.test_triton_kernels import CASES

    out = {name: spec for name, spec in CASES.items()}
    out["mixed_fp16"] = (CASES["mixed_bf16"][0], 3, 8, 2, 64, 16, "float16", False)
    out["llama8b_heads_d128_bs16"] = (
        [(1, 300), (1, 1000), (1, 7), (120, 400), (257, 257)],
        3,
        32,
        8,
        128,
        16,
        "bfloat16",
        False,
    )
    out["qwen_heads_d128_fp32"] = ([(1, 129), (1, 33), (64, 200)], 2, 14, 2, 128, 16, "float32", False)
    return out


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_on_cuda_matches_torch_and_reference(name):
    from pdserve.kernels import torch_attention, triton_attention
    from tests.kernels.test_torch_attention import make_case, reference

    seqs, nd, hq, hkv, d, bs, dtype, strided = CASES[name]
    dt = getattr(torch, dtype)
    case = make_case([tuple(s) for s in seqs], nd, hq, hkv, d, bs, dtype=dt, seed=hq + d + bs)
    dense = reference(case).cuda()  # [T, Hq, D] float64
    case = _on_cuda(case)
    q, k, v = case.query, case.key, case.value
    if strided:  # views of one fused qkv row, like the model's split
        t = q.shape[0]
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], 1)
        q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    out = triton_attention.paged_attention(q, k, v, case.kv_layer, case.meta, case.scale)
    ref = torch_attention.paged_attention(q, k, v, case.kv_layer, case.meta, case.scale)
    assert out.dtype == q.dtype and out.shape == q.shape and out.is_cuda
    assert (out.double() - ref.double()).abs().max().item() < TOL[dt]
    assert (out.double() - dense).abs().max().item() < TOL[dt]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_store_kv_on_cuda_equals_torch(dtype):
    from pdserve.kernels import torch_attention, triton_attention

    g = torch.Generator().manual_seed(1)
    n, bs, hkv, d, t = 7, 4, 2, 24, 10
    pool = torch.randn(2, n, bs, hkv, d, generator=g).to(dtype).cuda()
    qkv = torch.randn(t, 3 * hkv * d, generator=g).to(dtype).cuda()
    key, value = qkv[:, hkv * d : 2 * hkv * d].view(t, hkv, d), qkv[:, 2 * hkv * d :].view(t, hkv, d)
    slots = torch.tensor([5, -1, 0, 27, -1, 13, 14, 3, -1, 20], dtype=torch.int64, device="cuda")
    a, b = pool.clone(), pool.clone()
    triton_attention.store_kv(key, value, a, slots)
    torch_attention.store_kv(key, value, b, slots)
    assert torch.equal(a, b)
    assert not torch.equal(a, pool)  # something was written


def test_cuda_tensors_dispatch_to_triton_by_default(monkeypatch):
    import pdserve.kernels.attention as dispatch

    monkeypatch.delenv("PDSERVE_ATTENTION", raising=False)
    reload_env()
    assert dispatch.use_triton(torch.zeros(1, device="cuda"))
    assert not dispatch.use_triton(torch.zeros(1))


# (window, softcap, decode splits): sliding windows and soft-capping compiled for the device
WINDOW_CASES = {
    "window": (32, None, None),
    "window_small": (5, None, None),
    "softcap": (None, 2.0, None),
    "window_softcap": (16, 2.0, None),
    "window_split_decode": (32, None, 3),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(WINDOW_CASES))
def test_window_and_softcap_on_cuda_match_the_reference(name, dtype):
    from pdserve.kernels import triton_attention
    from tests.kernels.test_sliding_window_attention import NUM_DECODE, SEQS, reference
    from tests.kernels.test_torch_attention import make_case

    window, softcap, splits = WINDOW_CASES[name]
    case = make_case(SEQS, NUM_DECODE, 8, 2, 64, 16, dtype=dtype, seed=11)
    want = reference(case, window, softcap).cuda()  # [T, Hq, D] float64
    plain = reference(case, None, None).cuda()
    case = _on_cuda(case)
    out = triton_attention.paged_attention(
        case.query, case.key, case.value, case.kv_layer, case.meta, case.scale,
        decode_splits=splits, window=window, softcap=softcap,
    )  # fmt: skip
    assert (out.double() - want).abs().max().item() < TOL[dtype]
    assert (out.double() - plain).abs().max().item() > 0.05  # the option took effect
