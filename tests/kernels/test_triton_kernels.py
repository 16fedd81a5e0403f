"""Triton kernels under the interpreter (CPU) against the torch path and the dense reference.

TRITON_INTERPRET=1 must be set before triton is first imported, so the kernels run in one
subprocess (`python -m tests.kernels.test_triton_kernels CASES_JSON`, this same file) that
reports max errors as JSON; the tests below only read that report. Sizes are tiny: the
interpreter runs every program instance in Python.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

MIXED = [(1, 1), (1, 17), (1, 50), (7, 40), (33, 33), (1, 20), (40, 40), (5, 37), (16, 32)]
# name -> (seqs [(q_len, context_len)], num_decode, Hq, Hkv, D, block_size, dtype, strided q/k/v)
CASES: dict[str, tuple] = {
    "mixed_gqa4_d64_bs16": (MIXED, 3, 8, 2, 64, 16, "float32", False),
    "mixed_mha_d32_bs16": (MIXED, 3, 4, 4, 32, 16, "float32", False),
    "mixed_gqa2_d16_bs16_strided": (MIXED, 3, 4, 2, 16, 16, "float32", True),
    "mixed_gqa3_d16_bs4": (MIXED, 3, 6, 2, 16, 4, "float32", False),
    "mixed_d24_not_pow2": (MIXED[:5], 3, 4, 2, 24, 16, "float32", False),
    "decode_long_contexts": ([(1, 1), (1, 70), (1, 130), (1, 64)], 4, 4, 2, 32, 16, "float32", False),
    "prefill_many_q_tiles": ([(70, 100), (65, 65), (2, 90)], 0, 4, 2, 16, 16, "float32", False),
    "mixed_bf16": (MIXED, 3, 8, 2, 64, 16, "bfloat16", False),
    "decode_split_fp32": ([(1, 200), (1, 5), (1, 129), (6, 30)], 3, 4, 2, 16, 16, "float32", False),
    "decode_split_bf16": ([(1, 300), (1, 70), (1, 3)], 3, 8, 2, 64, 16, "bfloat16", False),
}
TOL = {"float32": 1e-4, "bfloat16": 3e-2}


SPLIT_CASES = {"decode_long_contexts": 3, "decode_split_fp32": 4, "decode_split_bf16": 3}  # name -> splits


def _case_errors(spec: tuple, decode_splits: int | None = None) -> dict[str, float]:
    """Run one case through triton and torch; max abs errors (subprocess side)."""
    import torch

    from pdserve.kernels import torch_attention, triton_attention
    from tests.kernels.test_torch_attention import make_case, reference

    seqs, nd, hq, hkv, d, bs, dtype, strided = spec
    case = make_case([tuple(s) for s in seqs], nd, hq, hkv, d, bs, dtype=getattr(torch, dtype), seed=hq + d + bs)
    q, k, v = case.query, case.key, case.value
    if strided:  # views of one fused qkv row, like the model's split
        t = q.shape[0]
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], 1)
        q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], dim=-1))
    out = triton_attention.paged_attention(q, k, v, case.kv_layer, case.meta, case.scale, decode_splits=decode_splits)
    ref_torch = torch_attention.paged_attention(q, k, v, case.kv_layer, case.meta, case.scale)
    dense = reference(case)
    return {
        "vs_torch": (out.double() - ref_torch.double()).abs().max().item(),
        "vs_reference": (out.double() - dense).abs().max().item(),
        "dtype_ok": float(out.dtype == q.dtype and out.shape == q.shape),
    }


def _store_errors() -> dict[str, float]:
    """Triton store_kv == torch store_kv (strided k/v, -1 slots, fp32 and bf16)."""
    import torch

    from pdserve.kernels import torch_attention, triton_attention

    res = {}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(1)
        n, bs, hkv, d, t = 7, 4, 2, 24, 10
        pool = torch.randn(2, n, bs, hkv, d, generator=g).to(dtype)
        qkv = torch.randn(t, 3 * hkv * d, generator=g).to(dtype)
        key, value = qkv[:, hkv * d : 2 * hkv * d].view(t, hkv, d), qkv[:, 2 * hkv * d :].view(t, hkv, d)
        slots = torch.tensor([5, -1, 0, 27, -1, 13, 14, 3, -1, 20], dtype=torch.int64)
        a, b = pool.clone(), pool.clone()
        triton_attention.store_kv(key, value, a, slots)
        torch_attention.store_kv(key, value, b, slots)
        res[str(dtype)] = float(torch.equal(a, b))
    return res


def _quantized_errors() -> dict[str, dict[str, float]]:
    """int8 and fp8 pools (kernels/kv_quant.py rows): the kernels read each row widened and scaled,
    so their output equals, bit for bit, theirs on the pool's dequantized values; and it is close
    to torch's path on the same pool (decodes, prefills, splits and a sliding window)."""
    import torch

    from pdserve.kernels import kv_quant, torch_attention, triton_attention
    from tests.kernels.test_torch_attention import make_case

    res = {}
    for fmt in (kv_quant.INT8, kv_quant.FP8):
        case = make_case(MIXED, 3, 8, 2, 64, 16, seed=21)
        pool = kv_quant.quantize(case.kv_layer, fmt)  # [2, N, bs, Hkv, D + 4]
        plain = kv_quant.dequantize(pool)  # [2, N, bs, Hkv, D] fp32
        q, k, v, meta, sc = case.query, case.key, case.value, case.meta, case.scale
        errs = {}
        for label, kw in (("whole", {}), ("split", {"decode_splits": 3}), ("window", {"window": 9})):
            out = triton_attention.paged_attention(q, k, v, pool, meta, sc, **kw)
            same = triton_attention.paged_attention(q, k, v, plain, meta, sc, **kw)
            ref = torch.empty_like(q)
            torch_attention.attend_decodes(q, pool, meta, sc, ref, kw.get("window"))
            torch_attention.attend_prefills(q, k, v, pool, meta, sc, ref, kw.get("window"))
            errs[f"{label}_equal_dequantized"] = float(torch.equal(out, same))
            errs[f"{label}_vs_torch"] = (out.double() - ref.double()).abs().max().item()
        res[fmt.kv_cache_dtype] = errs
    return res


def _dispatch_ok() -> float:
    """PDSERVE_ATTENTION=triton routes CPU tensors to the Triton kernels."""
    import torch

    from pdserve import kernels
    from pdserve.kernels import triton_attention
    from tests.kernels.test_torch_attention import make_case

    case = make_case(MIXED[:4], 3, 4, 2, 16, 16, seed=9)
    os.environ["PDSERVE_ATTENTION"] = "triton"
    from pdserve.env import reload

    reload()
    via = kernels.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)
    direct = triton_attention.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)
    return float(torch.equal(via, direct))


def main(argv: list[str]) -> None:
    names = json.loads(argv[0])
    report = {
        "cases": {name: _case_errors(CASES[name]) for name in names},
        "split_cases": {name: _case_errors(CASES[name], splits) for name, splits in SPLIT_CASES.items()},
        "store_kv": _store_errors(),
        "quantized": _quantized_errors(),
        "dispatch": _dispatch_ok(),
    }
    print(json.dumps(report))


@pytest.fixture(scope="module")
def report() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO), PDSERVE_ATTENTION="")
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_triton_kernels", json.dumps(list(CASES))],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_matches_torch(report, name):
    errs = report["cases"][name]
    tol = TOL[CASES[name][6]]
    assert errs["dtype_ok"] == 1.0
    assert errs["vs_torch"] < tol, errs
    assert errs["vs_reference"] < tol, errs


@pytest.mark.parametrize("name", list(SPLIT_CASES))
def test_split_kv_decode_matches_torch(report, name):
    """Flash-decoding: the context split over several programs, partials combined by log-sum-exp
    (some splits land past a short sequence's end and must weigh nothing)."""
    from pdserve.kernels.triton_attention import decode_block_n, plan_decode_splits

    seqs, nd, d = CASES[name][0], CASES[name][1], CASES[name][4]
    splits, _ = plan_decode_splits(max(c for _, c in seqs[:nd]), decode_block_n(d), SPLIT_CASES[name])
    assert splits == SPLIT_CASES[name]  # the context really is split that many ways
    errs = report["split_cases"][name]
    tol = TOL[CASES[name][6]]
    assert errs["vs_torch"] < tol, errs
    assert errs["vs_reference"] < tol, errs


def test_store_kv_matches_torch(report):
    assert all(v == 1.0 for v in report["store_kv"].values()), report["store_kv"]


def test_env_override_dispatches_to_triton(report):
    assert report["dispatch"] == 1.0


if __name__ == "__main__":
    main(sys.argv[1:])


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_pools_are_read_as_their_dequantized_values(report, kv_cache_dtype):
    errs = report["quantized"][kv_cache_dtype]
    for label in ("whole", "split", "window"):
        assert errs[f"{label}_equal_dequantized"] == 1.0, errs
        assert errs[f"{label}_vs_torch"] < 1e-4, errs
