"""`python -m pdserve.bench.prefill_attention`: prefill attention alone, each way this machine can
run it, against the matmul rate measured in the same run.

Cases, for each attention shape (`bench`: the bench model's 8 query / 4 KV heads, head_dim 64;
`smollm2`: SmolLM2-135M's 9 / 3, head_dim 64) and prompt length T:
  single   one prompt of T tokens
  ragged   one batch of four prompts of T/4, T/2, 3T/4 and T tokens
  chunked  a chunk of 512 query tokens with 1536 earlier tokens in the paged KV (once per shape)
The KV lies in a paged pool (blocks of 16, shuffled: no sequence's blocks are one run), in
--dtype (float32, or bfloat16: queries, pool and outputs; the tiled kernel takes fp32 only).

Ways (each one's output is checked against the torch reference before it is timed):
  flash-c   kernels/cpu_prefill_flash.c (full vector width, mask on diagonal tiles only)
  tiled-c   kernels/cpu_prefill_attention.c (its predecessor: 8-float vectors, every tile masked)
  sdpa      torch's CPU flash SDPA on contiguous [1, H, T, D] tensors made beforehand (is_causal,
            enable_gqa; a chunk after earlier context gets its bottom-right mask): SDPA alone
  sdpa+gather  the same with the gather out of the pool and the transposes timed too
  torch-ref kernels/torch_attention.py (the engine's pure-torch path)
  dispatch  kernels.paged_attention, as the engine calls it (only its prefill part here)

FLOPs of a chunk of q queries after p earlier tokens: 4 * D * Hq * (q * p + q (q + 1) / 2)
(Q K^T and P V, causal); for a whole prompt that is 2 * 2 * T (T + 1) / 2 * D * Hq.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.bench.machine import best_of, measure_matmul_gflops
from pdserve.kernels import cpu_native, torch_attention
from pdserve.kernels.metadata import AttentionMetadata

SHAPES = {"bench": (8, 4, 64), "smollm2": (9, 3, 64)}  # (Hq, Hkv, D)
BLOCK_SIZE = 16
CHUNK, CHUNK_PAST = 512, 1536


@dataclass
class Case:
    """One ragged prefill batch with its K/V stored in a paged pool."""

    name: str
    q_lens: list[int]
    ctx_lens: list[int]
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D] this step's rows (already in the pool)
    value: torch.Tensor  # [T, Hkv, D]
    kv_layer: torch.Tensor  # [2, N, bs, Hkv, D]
    meta: AttentionMetadata
    scale: float


def attention_flops(q_lens: list[int], ctx_lens: list[int], hq: int, d: int) -> int:
    """Causal FLOPs of Q K^T and P V for chunks of q_lens queries ending at ctx_lens keys."""
    keys_seen = sum(q * (c - q) + q * (q + 1) // 2 for q, c in zip(q_lens, ctx_lens))
    return 4 * d * hq * keys_seen


def make_case(
    name: str,
    q_lens: list[int],
    ctx_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    bs: int = BLOCK_SIZE,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """Random queries and KV; each sequence's blocks shuffled over the pool (never one run)."""
    g = torch.Generator().manual_seed(seed)
    counts = [-(-c // bs) for c in ctx_lens]
    num_blocks = sum(counts) + 1
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in counts:
        tables.append(ids[at : at + n])
        at += n
    kv_layer = torch.randn(2, num_blocks, bs, hkv, d, generator=g).to(dtype)  # [2, N, bs, Hkv, D]
    flat = kv_layer.view(2, num_blocks * bs, hkv, d)  # [2, N*bs, Hkv, D]
    keys, values = [], []
    for q, c, table in zip(q_lens, ctx_lens, tables):
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(c - q, c)])  # [q]
        keys.append(flat[0, slots])
        values.append(flat[1, slots])
    query = torch.randn(sum(q_lens), hq, d, generator=g).to(dtype)  # [T, Hq, D]
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, 0)
    return Case(name, q_lens, ctx_lens, query, torch.cat(keys), torch.cat(values), kv_layer, meta, 1 / math.sqrt(d))


def cases_for(
    hq: int, hkv: int, d: int, lengths: list[int], chunked: bool, dtype: torch.dtype = torch.float32
) -> list[Case]:
    out = []
    for t in lengths:
        out.append(make_case(f"single {t}", [t], [t], hq, hkv, d, dtype=dtype))
        ragged = [max(1, t * i // 4) for i in (1, 2, 3, 4)]
        out.append(make_case(f"ragged 4x<={t}", ragged, ragged, hq, hkv, d, dtype=dtype))
    if chunked:
        past = [CHUNK + CHUNK_PAST]
        out.append(make_case(f"chunk {CHUNK} after {CHUNK_PAST}", [CHUNK], past, hq, hkv, d, dtype=dtype))
    return out


def run_c_kernel(case: Case, source: Path) -> torch.Tensor:
    out = torch.empty_like(case.query)
    m = case.meta
    ok = cpu_native.paged_prefill_attention(
        case.query, case.kv_layer, m.block_tables, m.cu_seqlens_q, m.context_lens, 0, case.scale, out, source
    )
    assert ok, f"{source.name} refused the case"
    return out


def _gathered(case: Case, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sequence b's q [1, Hq, q, D], k and v [1, Hkv, c, D], contiguous, gathered from the pool."""
    s, e, c = case.meta.cu_seqlens_q_cpu[b], case.meta.cu_seqlens_q_cpu[b + 1], case.ctx_lens[b]
    bs = case.kv_layer.shape[2]
    kv = torch_attention.gather_kv(case.kv_layer, case.meta.block_tables[b : b + 1, : -(-c // bs)])
    q = case.query[s:e].transpose(0, 1).contiguous()[None]  # [1, Hq, q, D]
    k = kv[0, 0, :c].transpose(0, 1).contiguous()[None]  # [1, Hkv, c, D]
    v = kv[1, 0, :c].transpose(0, 1).contiguous()[None]  # [1, Hkv, c, D]
    return q, k, v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """[1, Hq, q, D] x [1, Hkv, c, D] -> [1, Hq, q, D], causal, bottom-right when c > q."""
    ql, c = q.shape[2], k.shape[2]
    if ql == c:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    mask = torch.arange(c)[None, :] <= torch.arange(ql)[:, None] + (c - ql)  # [q, c]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def sdpa_runner(case: Case) -> Callable[[], torch.Tensor]:
    """SDPA alone: the contiguous inputs are made once, outside the timed call."""
    inputs = [_gathered(case, b) for b in range(len(case.q_lens))]

    def run() -> torch.Tensor:
        outs = [_sdpa(q, k, v, case.scale)[0].transpose(0, 1) for q, k, v in inputs]  # [q, Hq, D] each
        return torch.cat(outs)

    return run


def run_sdpa_gather(case: Case) -> torch.Tensor:
    out = torch.empty_like(case.query)
    cu = case.meta.cu_seqlens_q_cpu
    for b in range(len(case.q_lens)):
        q, k, v = _gathered(case, b)
        out[cu[b] : cu[b + 1]] = _sdpa(q, k, v, case.scale)[0].transpose(0, 1)
    return out


def run_torch_ref(case: Case) -> torch.Tensor:
    out = torch.empty_like(case.query)
    torch_attention.attend_prefills(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale, out)
    return out


def run_dispatch(case: Case) -> torch.Tensor:
    return kernels.paged_attention(case.query, case.key, case.value, case.kv_layer, case.meta, case.scale)


def runners(case: Case) -> dict[str, Callable[[], torch.Tensor]]:
    ways: dict[str, Callable[[], torch.Tensor]] = {}
    for way, source in (("flash-c", cpu_native.FLASH_SOURCE), ("tiled-c", cpu_native.PREFILL_SOURCE)):
        if cpu_native.can_run_prefill(case.query, case.kv_layer, source):
            ways[way] = functools.partial(run_c_kernel, case, source)
    ways["sdpa"] = sdpa_runner(case)
    ways["sdpa+gather"] = lambda: run_sdpa_gather(case)
    ways["torch-ref"] = lambda: run_torch_ref(case)
    ways["dispatch"] = lambda: run_dispatch(case)
    return ways


def bench_case(case: Case, hq: int, d: int, repeat: int) -> list[dict]:
    """Each way's best time on `case`, after checking its output against the torch reference."""
    flops = attention_flops(case.q_lens, case.ctx_lens, hq, d)
    ref = run_torch_ref(case)
    tolerance = 1e-4 if case.query.dtype == torch.float32 else 5e-2  # bf16: a few of its ulps
    rows = []
    for way, fn in runners(case).items():
        err = (fn().float() - ref.float()).abs().max().item()
        if err > tolerance:
            raise AssertionError(f"{case.name}: {way} differs from the torch reference by {err:.2e}")
        t = best_of(fn, repeat)
        rows.append({"case": case.name, "way": way, "ms": t * 1e3, "gflops": flops / t / 1e9, "max_abs_err": err})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pdserve.bench.prefill_attention",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--shapes", default="bench,smollm2", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--lengths", default="128,512,2048")
    ap.add_argument("--no-chunked", action="store_true", help="skip the chunk after earlier context")
    ap.add_argument("--repeat", type=int, default=5, help="each figure is the best of this many calls")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    matmul = measure_matmul_gflops()
    rows = []
    with torch.inference_mode():
        for shape in args.shapes.split(","):
            hq, hkv, d = SHAPES[shape]
            for case in cases_for(hq, hkv, d, lengths, not args.no_chunked, getattr(torch, args.dtype)):
                for r in bench_case(case, hq, d, args.repeat):
                    rows.append({"shape": shape, **r})
    matmul = max(matmul, measure_matmul_gflops())  # the higher of before and after (a shared host varies)
    for r in rows:
        r["matmul_share"] = r["gflops"] / matmul
    result = {"threads": torch.get_num_threads(), "dtype": args.dtype, "matmul_gflops": matmul, "rows": rows}
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"{args.dtype}, {torch.get_num_threads()} threads, matmul {matmul:.1f} GFLOP/s fp32 "
        "(same run, higher of before/after)"
    )
    print(f"{'shape':<8} {'case':<22} {'way':<12} {'ms':>8} {'GFLOP/s':>8} {'of matmul':>9}")
    for r in rows:
        print(
            f"{r['shape']:<8} {r['case']:<22} {r['way']:<12} {r['ms']:>8.2f} {r['gflops']:>8.1f} "
            f"{r['matmul_share']:>9.1%}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
