"""`python -m pdserve.bench.quantized_linear`: weight-only int8 / int4 linears on the CPU
(kernels/quant_gemm.py) against the engine's fp32 path and torch's own weight-only kernels,
then the engine's batch-1 decode tokens/s and weight memory, fp32 vs int8 vs int4.

Part 1, per linear of a real small model's shape (hidden 576, intermediate 1536, 9 heads of 64,
3 KV heads; vocab 49152) at 1, 4, 16 and 256 rows: time of fp32 (PackedLinear: C panel GEMM up
to 16 rows, oneDNN beyond), ours, torch._weight_int8pack_mm (per-channel int8) and
torch._weight_int4pack_mm_for_cpu (groups of 32), each as a ratio to fp32 (< 1: faster). Each
shape's weights are cycled through COPIES copies, so they stream from memory as in a real step.
Part 2: `make_model(preset="real")` served at batch 1 (decode steps at a short context).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from pdserve.bench.engine_throughput import bench_decode
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.cpu_linear import PackedLinear, TransposedLinear, cpu_linear_kind
from pdserve.engine.quantize import quantize
from pdserve.env import settings
from pdserve.kernels import quant_gemm
from pdserve.modelgen.make_model import PRESETS, make_model

P = PRESETS["real"]
SHAPES = {  # name -> (out, in)
    "qkv": ((P.num_heads + 2 * P.num_kv_heads) * (P.hidden_size // P.num_heads), P.hidden_size),
    "o": (P.hidden_size, P.hidden_size),
    "gate_up": (2 * P.intermediate_size, P.hidden_size),
    "down": (P.hidden_size, P.intermediate_size),
    "lm_head": (P.vocab_size, P.hidden_size),
}
ROWS = (1, 4, 16, 256)
COPIES = 8  # weights per shape, cycled: ~the L2/L3 does not hold them all
Run = Callable[[torch.Tensor], torch.Tensor]


def _time(fns: list[Run], x: torch.Tensor, budget_s: float) -> float:
    """Seconds of one call (the 20th percentile: the host is shared), cycling over `fns` (one per weight copy)."""
    for f in fns:
        f(x)
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    while time.perf_counter() < t_end or len(times) < 5:
        for f in fns:
            t0 = time.perf_counter()
            f(x)
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 5]


def _fp32(w: torch.Tensor) -> Run:
    linear = nn.Linear(w.shape[1], w.shape[0], bias=False)
    linear.weight.data = w
    m = PackedLinear(linear) if cpu_linear_kind(w.dtype) == "packed" else TransposedLinear(linear)
    return m.forward


def _ours(w: torch.Tensor, scheme: str) -> Run:
    qw = quantize(w, scheme)
    return lambda x: quant_gemm.linear(x, qw, None)


def _torch_int8(w: torch.Tensor) -> Run:
    scales = w.abs().amax(dim=1) / 127  # [out]
    q = torch.round(w / scales[:, None]).to(torch.int8)  # [out, in]
    return lambda x: torch._weight_int8pack_mm(x, q, scales)


def _torch_int4(w: torch.Tensor) -> Run:
    out, n_in = w.shape
    g = w.view(out, n_in // 32, 32)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp_min(1e-8)  # [out, G]
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).view(out, n_in)
    zeros = lo + 8 * scale  # torch's int4 format: w = (q - 8) * scale + zero
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale.t(), zeros.t()], dim=-1).contiguous()  # [G, out, 2]
    return lambda x: torch._weight_int4pack_mm_for_cpu(x, packed, 32, sz)


KINDS: dict[str, Callable[[torch.Tensor], Run]] = {
    "fp32": _fp32,
    "int8": lambda w: _ours(w, "int8"),
    "int4": lambda w: _ours(w, "int4"),
    "torch_int8": _torch_int8,
    "torch_int4": _torch_int4,
}


def bench_linears(budget_s: float) -> None:
    print(f"linears (torch threads {torch.get_num_threads()}): fp32 time, and each kind's time / fp32's")
    print(f"{'shape':>16} {'rows':>4} {'fp32 us':>9} " + " ".join(f"{k:>10}" for k in list(KINDS)[1:]))
    for name, (out, n_in) in SHAPES.items():
        copies = 2 if name == "lm_head" else COPIES
        weights = [torch.randn(out, n_in) * 0.05 for _ in range(copies)]
        runs = {kind: [make(w) for w in weights] for kind, make in KINDS.items()}
        for rows in ROWS:
            x = torch.randn(rows, n_in)
            t = {kind: _time(fns, x, budget_s) for kind, fns in runs.items()}
            ratios = " ".join(f"{t[k] / t['fp32']:>10.2f}" for k in list(KINDS)[1:])
            print(f"{name + f' {out}x{n_in}':>16} {rows:>4} {t['fp32'] * 1e6:>9.0f} {ratios}", flush=True)


def _weight_bytes(engine: LLMEngine) -> int:
    return sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())


def bench_decode_engine(model: Path, steps: int) -> None:
    print(f"\ndecode at batch 1, {model.name} (real preset), context ~64 tokens, {steps} steps a scheme")
    results = {}
    for scheme in ("none", "int8", "int4"):
        cfg = EngineConfig(
            model=str(model),
            dtype="float32",
            quantization=scheme,
            cache=CacheConfig(num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512, max_model_len=256),
        )
        engine = LLMEngine(cfg, show_progress=False)
        dt = min(bench_decode(engine, 1, 64, steps) for _ in range(2))
        results[scheme] = (1 / dt, _weight_bytes(engine))
        del engine
    base_tps, base_bytes = results["none"]
    print(f"{'scheme':>6} {'tok/s':>8} {'x fp32':>7} {'weights MiB':>12} {'x fp32':>7}")
    for scheme, (tps, nbytes) in results.items():
        name = "fp32" if scheme == "none" else scheme
        print(f"{name:>6} {tps:>8.1f} {tps / base_tps:>7.2f} {nbytes / 2**20:>12.1f} {nbytes / base_bytes:>7.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.quantized_linear", description=__doc__)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--budget", type=float, default=0.3, help="seconds of timing per cell")
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per scheme")
    ap.add_argument("--skip-engine", action="store_true", help="the linears table only")
    ap.add_argument("--skip-linears", action="store_true", help="the engine's decode only")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.skip_linears:
        with torch.inference_mode():
            bench_linears(args.budget)
    if not args.skip_engine:
        model = make_model(settings().model_cache_dir / "models" / "bench-real-llama", preset="real", quiet=True)
        bench_decode_engine(model, args.steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
