"""The quantized CPU kernels built for each x86-64 level this CPU runs, timed side by side in one
run: `python -m pdserve.bench.kernel_isa [--threads 1] [--json F]`.

Each level (PDSERVE_KERNEL_ISA: the machine's own `native`, `avx512` = x86-64-v4 without VNNI,
`avx2` = x86-64-v3, `sse2` = the baseline) runs in a process of its own, the levels alternating
over `--rounds`; a case's figure is its best round. Weights are random, of Llama-3.2-1B's
ffn_gate shape (8,192 x 2,048):
- GGUF blocks as stored (kernels/cpu_block_dot.c: Q4_K, Q5_K, Q6_K, Q8_0; x quantized to int8)
  at 1 row (decode: weight bytes read a second, against the read ceiling measured in the same
  process) and at 16 and 128 rows (prefill: int8 products a second, against the core's maddubs +
  madd ceiling, bench/int8_mac_ceiling.c);
- weight-only int4 / int8 (kernels/cpu_quant_gemm.c, fp32 activations; Q4_0 files map onto int4)
  at 1 and 16 rows, and with int8 activations (kernels/cpu_quant_dot.c) at 1 row.
At one row each call reads a different copy of the weight (COPIES of them), so the weights stream
from memory as in a decode step rather than sitting in cache."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

GATE = (8192, 2048)  # Llama-3.2-1B ffn_gate [out, in]
BLOCK_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
COPIES = 6  # weights cycled at one row: > the L3 of the machines measured
BLOCK_ROWS = (1, 16, 128)
QUANT_ROWS = (1, 16)


def _best_seconds(fn: Callable[[int], object], copies: int, budget: float) -> float:
    """Fastest mean time of one `fn(copy)` call over rounds of `copies` calls within `budget` s."""
    for i in range(copies):
        fn(i)  # warm up: every copy once (first-touch pages, kernel build)
    best, t_end = float("inf"), time.perf_counter() + budget
    while True:
        t0 = time.perf_counter()
        for i in range(copies):
            fn(i)
        best = min(best, (time.perf_counter() - t0) / copies)
        if time.perf_counter() > t_end:
            return best


def _block_call(x: torch.Tensor, weights: list, i: int) -> torch.Tensor:
    from pdserve.kernels import block_gemm

    return block_gemm.linear(x, weights[i], None)


def _quant_call(x: torch.Tensor, weights: list, int8x: bool, i: int) -> torch.Tensor:
    from pdserve.kernels import quant_gemm

    return quant_gemm.linear(x, weights[i], None, int8_activations=int8x)


def _child(budget: float) -> dict[str, float]:
    """This process's level (PDSERVE_KERNEL_ISA): every case's figure, and the ceilings."""
    import gguf

    from pdserve.bench.block_gemm_ceiling import mac_ceiling
    from pdserve.bench.machine import measure_read_gbps
    from pdserve.engine.quantize import quantize
    from pdserve.kernels import block_gemm
    from pdserve.modelgen.random_blocks import random_blocks

    out_f, in_f = GATE
    try:
        mac = mac_ceiling() / 1e9
    except RuntimeError:  # the baseline build has no maddubs
        mac = float("nan")
    res = {"read_gbps": measure_read_gbps(), "mac_gprod": mac}
    for name in BLOCK_TYPES:
        qtype = gguf.GGMLQuantizationType[name]
        blocks = [
            block_gemm.BlockWeight(int(qtype), torch.from_numpy(random_blocks(qtype, out_f, in_f, seed=c)), in_f)
            for c in range(COPIES)
        ]
        for m in BLOCK_ROWS:
            t = _best_seconds(partial(_block_call, torch.randn(m, in_f), blocks), COPIES if m == 1 else 1, budget)
            res[f"block {name} {m}"] = blocks[0].nbytes() / t / 1e9 if m == 1 else m * out_f * in_f / t / 1e9
    dense = [torch.randn(out_f, in_f) / in_f**0.5 for _ in range(2)]
    for scheme in ("int4", "int8"):
        quant = [quantize(dense[c % 2], scheme) for c in range(COPIES)]
        nbytes = quant[0].q.numel() + 4 * quant[0].scales.numel()
        for m, int8x in [(m, False) for m in QUANT_ROWS] + [(1, True)]:
            call = partial(_quant_call, torch.randn(m, in_f), quant, int8x)
            t = _best_seconds(call, COPIES if m == 1 else 1, budget)
            key = f"{scheme}{' int8-x' if int8x else ''} {m}"
            res[key] = nbytes / t / 1e9 if m == 1 else m * out_f * in_f / t / 1e9
    return res


def _levels(wanted: list[str]) -> list[str]:
    from pdserve.kernels.cpu_native import isa_unrunnable

    return [isa for isa in wanted if isa == "native" or isa_unrunnable(isa) is None]


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "?")
    flags = next((set(ln.split(":", 1)[1].split()) for ln in lines if ln.startswith("flags")), set())
    isa = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16") if f in flags]
    return f"{name}, {os.cpu_count()} logical CPUs, {' '.join(isa)}"


def _row(case: str) -> tuple[str, str]:
    """A case key -> (what it is, its unit)."""
    kind, m = case.rsplit(" ", 1)
    if m == "1":
        return f"{kind.replace('block ', '')}, 1 row", "GB/s of weights"
    return f"{kind.replace('block ', '')}, {m} rows", "G int8 products/s" if "block" in kind else "G MACs/s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--isas", default="native,avx512,avx2,sse2", help="levels to build, those this CPU runs")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="each level's process this many times, alternating")
    ap.add_argument("--budget", type=float, default=0.4, help="seconds a case a round")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        print(json.dumps(_child(args.budget)))
        return 0
    levels = _levels(args.isas.split(","))
    print(f"CPU: {_cpu()}; {args.threads} thread(s); levels: {', '.join(levels)}", flush=True)
    best: dict[str, dict[str, float]] = {isa: {} for isa in levels}
    for r in range(args.rounds):
        for isa in levels:
            cmd = [sys.executable, "-m", "pdserve.bench.kernel_isa", "--child", "--threads", str(args.threads)]
            cmd += ["--budget", str(args.budget)]
            env = {**os.environ, "PDSERVE_KERNEL_ISA": isa}
            t0 = time.perf_counter()
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            for k, v in json.loads(out.strip().splitlines()[-1]).items():
                best[isa][k] = max(best[isa].get(k, v), v)
            print(f"  round {r + 1}/{args.rounds} {isa}: {time.perf_counter() - t0:.0f} s", flush=True)
    base = levels[0]
    for key, what in (("read_gbps", "read ceiling, GB/s"), ("mac_gprod", "int8 maddubs+madd ceiling, G products/s")):
        print(f"{what}: " + " / ".join(f"{best[i][key]:.1f}" for i in levels))
    print()
    print("| kernel | unit | " + " | ".join(levels) + " | / ceiling (" + ", ".join(levels) + ") |")
    print("|---|---|" + "---:|" * (len(levels) + 1))
    for case in (k for k in best[base] if k not in ("read_gbps", "mac_gprod")):
        what, unit = _row(case)
        ceiling = "read_gbps" if case.endswith(" 1") else "mac_gprod" if case.startswith("block") else ""
        vals = " | ".join(
            f"{best[i][case]:.1f}" + ("" if i == base else f" ({best[i][case] / best[base][case]:.2f}x)")
            for i in levels
        )
        ratios = ", ".join(f"{best[i][case] / best[i][ceiling]:.2f}" if ceiling else "-" for i in levels)
        print(f"| {what} | {unit} | {vals} | {ratios} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": _cpu(), "threads": args.threads, "figures": best}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
