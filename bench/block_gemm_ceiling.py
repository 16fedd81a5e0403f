"""The K-quant block GEMM (kernels/cpu_block_dot.c) against the int8 multiply-add ceiling of the
core it runs on, measured in the same run: `python -m pdserve.bench.block_gemm_ceiling --model F.gguf`.

The ceiling (bench/int8_mac_ceiling.c): 8 independent chains of AVX2 maddubs + madd, the pair the
kernel spends on each 32 products, timed on one thread: int8 products a second. The GEMM: one
layer's tensors of the file (ffn_gate, ffn_down) at 1-256 rows on one thread, products a second
(rows x out x in / seconds), and their ratio to the ceiling. Where that ratio is near 1, prefill
and batched decode through these blocks can only go faster with other instructions (VNNI)."""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch

from pdserve.kernels import block_gemm
from pdserve.kernels.cpu_native import load_kernel

CEILING_SOURCE = Path(__file__).with_name("int8_mac_ceiling.c")


def mac_ceiling(seconds: float = 0.5) -> float:
    """int8 products a second on one thread (32 a maddubs + madd pair), best of 5."""
    lib = load_kernel(CEILING_SOURCE)
    if lib is None:
        raise RuntimeError("no C compiler: the ceiling cannot be measured")
    lib.int8_mac_pairs.restype = ctypes.c_int64
    lib.int8_mac_pairs.argtypes = [ctypes.c_int64]
    if lib.int8_mac_pairs(1) < 0:
        raise RuntimeError("not an AVX2 build: no maddubs to measure")
    iters, best = 1 << 20, 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        lib.int8_mac_pairs(iters)
        dt = time.perf_counter() - t0
        best = max(best, iters * 8 * 32 / dt)
        iters = max(iters, int(iters * seconds / max(dt, 1e-6)))
    return best


def gemm_rate(w: block_gemm.BlockWeight, m: int) -> float:
    """Products a second of `block_gemm.linear` at `m` rows, one thread, best of 5 rounds."""
    x = torch.randn(m, w.in_features)
    block_gemm.linear(x, w, None)
    reps, best = max(1, 32 // m), float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            block_gemm.linear(x, w, None)
        best = min(best, (time.perf_counter() - t0) / reps)
    return m * w.out_features * w.in_features / best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a GGUF file whose K-quant tensors to run")
    ap.add_argument("--layer", type=int, default=0)
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument(
        "--tensors", default="ffn_gate,ffn_down", help="the layer's tensors, by GGUF name: attn_q,attn_v,ffn_up,..."
    )
    args = ap.parse_args(argv)
    import gguf

    torch.set_num_threads(1)
    tensors = {t.name: t for t in gguf.GGUFReader(args.model).tensors}
    ceiling = mac_ceiling()
    print(f"int8 multiply-add ceiling, one thread: {ceiling / 1e9:.1f} G products/s")
    print("| tensor | type | rows | G products/s | / ceiling |")
    print("|---|---|---:|---:|---:|")
    for name in (f"blk.{args.layer}.{t}.weight" for t in args.tensors.split(",")):
        t = tensors[name]
        out, inn = int(t.shape[1]), int(t.shape[0])
        w = block_gemm.BlockWeight(int(t.tensor_type), torch.from_numpy(t.data.reshape(out, -1).copy()), inn)
        for m in (int(r) for r in args.rows.split(",")):
            rate = gemm_rate(w, m)
            print(f"| {name} | {w.name} | {m} | {rate / 1e9:.1f} | {rate / ceiling:.2f} |", flush=True)
    print(f"ceiling again (drift check): {mac_ceiling() / 1e9:.1f} G products/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
