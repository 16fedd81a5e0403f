"""The K-quant block GEMM (kernels/cpu_block_dot.c) against the int8 multiply-add ceiling of the
core it runs on, measured in the same run: `python -m pdserve.bench.block_gemm_ceiling --model F.gguf`.

The ceilings (bench/int8_mac_ceiling.c): 8 independent chains of AVX2 maddubs + madd, the pair the
AVX2 kernel spends on each 32 products, and on an AVX-512 machine 12 chains of the zmm pair (maddubs
then VNNI's dpwssd, or madd + add), timed on one thread: int8 products a second. The GEMM: one
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


def mac_ceiling(seconds: float = 0.5, width: str = "ymm") -> float:
    """int8 products a second on one thread, best of 5: `ymm` the AVX2 maddubs + madd pair (32
    products), `zmm` the AVX-512 pair the K-quant kernels spend on this build (64; 0.0 without
    AVX-512 BW)."""
    lib = load_kernel(CEILING_SOURCE)
    if lib is None:
        raise RuntimeError("no C compiler: the ceiling cannot be measured")
    fn, chains, products = (lib.int8_mac_pairs, 8, 32) if width == "ymm" else (lib.int8_mac_pairs_zmm, 12, 64)
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int64]
    if fn(1) < 0:
        if width == "zmm":
            return 0.0
        raise RuntimeError("not an AVX2 build: no maddubs to measure")
    iters, best = 1 << 20, 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        fn(iters)
        dt = time.perf_counter() - t0
        best = max(best, iters * chains * products / dt)
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
    ceiling, wide = mac_ceiling(), mac_ceiling(width="zmm")
    print(f"int8 multiply-add ceilings, one thread: ymm pairs {ceiling / 1e9:.1f} G products/s", end="")
    print(f", zmm pairs {wide / 1e9:.1f}" if wide else " (no AVX-512 BW)")
    print("| tensor | type | rows | G products/s | / ymm ceiling | / zmm ceiling |")
    print("|---|---|---:|---:|---:|---:|")
    for name in (f"blk.{args.layer}.{t}.weight" for t in args.tensors.split(",")):
        t = tensors[name]
        out, inn = int(t.shape[1]), int(t.shape[0])
        w = block_gemm.BlockWeight(int(t.tensor_type), torch.from_numpy(t.data.reshape(out, -1).copy()), inn)
        for m in (int(r) for r in args.rows.split(",")):
            rate = gemm_rate(w, m)
            zmm = f"{rate / wide:.2f}" if wide else "-"
            print(f"| {name} | {w.name} | {m} | {rate / 1e9:.1f} | {rate / ceiling:.2f} | {zmm} |", flush=True)
    print(
        f"ceilings again (drift check): ymm {mac_ceiling() / 1e9:.1f}, zmm {mac_ceiling(width='zmm') / 1e9:.1f} G products/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
