"""`pdserve bench-gpu`: the Triton paged-attention kernels on a CUDA device, beside that device's
own ceilings measured in the same run.

    decode:  KV bytes read / kernel time, as a fraction of device-to-device copy bandwidth
             (copy counted as bytes read + bytes written)
    prefill: causal attention FLOPs (4 * Hq * D * sum over queries of visible keys) / time, beside
             torch's dense SDPA (flash attention) on the same tokens without paging

Each figure also has the pure-torch paged path (what CPU runs) for scale.
"""

from __future__ import annotations

import argparse
import json

import torch


def _bench_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50)


def device_copy_gbps(nbytes: int = 2 * 2**30) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench_ms(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def matmul_tflops(n: int = 8192, dtype=torch.bfloat16) -> float:
    a = torch.randn(n, n, dtype=dtype, device="cuda")
    b = torch.randn(n, n, dtype=dtype, device="cuda")
    return 2 * n**3 / (_bench_ms(lambda: a @ b) * 1e-3) / 1e12


def paged_case(
    q_lens: list[int],
    ctx_lens: list[int],
    num_decode: int,
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    dtype: torch.dtype,
    seed: int = 0,
):
    """Random paged KV with shuffled block tables; q/k/v for this step's tokens."""
    from pdserve.kernels import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    counts = [-(-c // bs) for c in ctx_lens]
    perm = torch.randperm(sum(counts) + 8, generator=g).tolist()
    tables, at = [], 0
    for n in counts:
        tables.append(perm[at : at + n])
        at += n
    kv = torch.randn(2, len(perm), bs, hkv, d, dtype=dtype, device="cuda")  # [2, N, bs, Hkv, D]
    t = sum(q_lens)
    q = torch.randn(t, hq, d, dtype=dtype, device="cuda")  # [T, Hq, D]
    k = torch.randn(t, hkv, d, dtype=dtype, device="cuda")  # [T, Hkv, D]
    meta = AttentionMetadata.build(q_lens, ctx_lens, tables, num_decode, device="cuda")
    return q, k, k.clone(), kv, meta


def bench_decode(batch: int, ctx: int, hq=32, hkv=8, d=128, bs=16, dtype=torch.bfloat16) -> dict:
    from pdserve.kernels import torch_attention, triton_attention

    q, k, v, kv, meta = paged_case([1] * batch, [ctx] * batch, batch, hq, hkv, d, bs, dtype)
    scale = d**-0.5
    tri = _bench_ms(lambda: triton_attention.paged_attention(q, k, v, kv, meta, scale))
    one = _bench_ms(lambda: triton_attention.paged_attention(q, k, v, kv, meta, scale, decode_splits=1))
    tor = _bench_ms(lambda: torch_attention.paged_attention(q, k, v, kv, meta, scale))
    kv_bytes = 2 * batch * ctx * hkv * d * kv.element_size()
    return {
        "batch": batch,
        "context": ctx,
        "triton_us": tri * 1e3,
        "triton_unsplit_us": one * 1e3,
        "torch_us": tor * 1e3,
        "triton_kv_gbps": kv_bytes / (tri * 1e-3) / 1e9,
        "torch_kv_gbps": kv_bytes / (tor * 1e-3) / 1e9,
    }


def bench_prefill(num_seqs: int, q_len: int, hq=32, hkv=8, d=128, bs=16, dtype=torch.bfloat16) -> dict:
    from pdserve.kernels import torch_attention, triton_attention

    q, k, v, kv, meta = paged_case([q_len] * num_seqs, [q_len] * num_seqs, 0, hq, hkv, d, bs, dtype)
    scale = d**-0.5
    tri = _bench_ms(lambda: triton_attention.paged_attention(q, k, v, kv, meta, scale))
    tor = _bench_ms(lambda: torch_attention.paged_attention(q, k, v, kv, meta, scale))
    # dense reference: flash SDPA over [B, Hq, S, D] with GQA expanded
    qd = q.view(num_seqs, q_len, hq, d).transpose(1, 2)  # [B, Hq, S, D]
    kd = torch.randn(num_seqs, hq, q_len, d, dtype=dtype, device="cuda")  # [B, Hq, S, D]
    sdpa = _bench_ms(lambda: torch.nn.functional.scaled_dot_product_attention(qd, kd, kd, is_causal=True))
    flops = 4 * hq * d * num_seqs * q_len * (q_len + 1) / 2
    return {
        "num_seqs": num_seqs,
        "q_len": q_len,
        "triton_us": tri * 1e3,
        "torch_us": tor * 1e3,
        "sdpa_us": sdpa * 1e3,
        "triton_tflops": flops / (tri * 1e-3) / 1e12,
        "sdpa_tflops": flops / (sdpa * 1e-3) / 1e12,
    }


PREFILL_TILES = [
    (64, 16, 4, 2),
    (64, 32, 4, 2),
    (64, 64, 4, 3),
    (128, 32, 8, 2),
    (128, 64, 8, 2),
    (128, 64, 8, 3),
    (128, 128, 8, 2),
    (64, 64, 8, 3),
    (128, 32, 4, 3),
]


def tune_prefill(num_seqs: int = 4, q_len: int = 2048, hq=32, hkv=8, d=128, bs=16, dtype=torch.bfloat16) -> list[dict]:
    """TFLOP/s of each (BLOCK_M, BLOCK_N, warps, stages) on one prefill shape, checked against
    the default tiles' output."""
    from pdserve.kernels import triton_attention

    q, k, v, kv, meta = paged_case([q_len] * num_seqs, [q_len] * num_seqs, 0, hq, hkv, d, bs, dtype)
    scale = d**-0.5
    want = triton_attention.paged_attention(q, k, v, kv, meta, scale)
    flops = 4 * hq * d * num_seqs * q_len * (q_len + 1) / 2
    rows = []
    for tiles in PREFILL_TILES:
        try:
            got = triton_attention.paged_attention(q, k, v, kv, meta, scale, prefill_tiles=tiles)
            err = (got.float() - want.float()).abs().max().item()
            ms = _bench_ms(lambda: triton_attention.paged_attention(q, k, v, kv, meta, scale, prefill_tiles=tiles))
            rows.append({"tiles": tiles, "tflops": flops / (ms * 1e-3) / 1e12, "max_err": err})
        except Exception as e:  # out of shared memory and the like: recorded, not fatal
            rows.append({"tiles": tiles, "error": repr(e)[:200]})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="pdserve bench-gpu", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--tune-prefill", action="store_true", help="also time a set of prefill tile shapes")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("pdserve bench-gpu needs a CUDA device")
    res: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_gbps": device_copy_gbps(),
        "matmul_bf16_tflops": matmul_tflops(),
        "shape": "Hq 32, Hkv 8, D 128, block 16, bf16 (Llama-3-8B attention)",
    }
    res["decode"] = [
        bench_decode(b, c)
        for b in (1, 4, 16, 64, 256)
        for c in (512, 2048, 8192, 32768)
        if b * c <= 256 * 2048 and (b == 1 or c <= 8192)
    ]
    res["prefill"] = [bench_prefill(n, s) for n, s in ((1, 512), (1, 4096), (8, 512), (4, 2048))]
    if args.tune_prefill:
        res["prefill_tiles"] = tune_prefill()
    for r in res["decode"]:
        r["triton_bw_util"] = r["triton_kv_gbps"] / res["copy_gbps"]
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(
        f"{res['device']}: copy {res['copy_gbps']:.0f} GB/s (read+write), bf16 matmul "
        f"{res['matmul_bf16_tflops']:.0f} TFLOP/s; {res['shape']}"
    )
    print(f"{'decode B':>8} {'ctx':>6} {'triton us':>10} {'GB/s':>7} {'of copy':>8} {'torch us':>9}")
    for r in res["decode"]:
        print(
            f"{r['batch']:>8} {r['context']:>6} {r['triton_us']:>10.1f} {r['triton_kv_gbps']:>7.0f} "
            f"{r['triton_bw_util']:>8.1%} {r['torch_us']:>9.1f}"
        )
    print(f"{'prefill B':>9} {'len':>5} {'triton us':>10} {'TFLOP/s':>8} {'sdpa us':>8} {'TFLOP/s':>8} {'torch us':>9}")
    for r in res["prefill"]:
        print(
            f"{r['num_seqs']:>9} {r['q_len']:>5} {r['triton_us']:>10.1f} {r['triton_tflops']:>8.1f} "
            f"{r['sdpa_us']:>8.1f} {r['sdpa_tflops']:>8.1f} {r['torch_us']:>9.1f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
