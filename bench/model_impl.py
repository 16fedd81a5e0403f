"""`python -m pdserve.bench.model_impl`: tokens/s of the transformers backend (transformers'
modelling code over pdserve's paged KV cache) against the native model, on one Llama folder in
one process: decode at batch 1 and 16, and a 512-token prefill. Each figure is the best of
--repeats runs; the two paths alternate, so background load hits both alike.
"""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

import torch

from pdserve.bench.engine_throughput import bench_decode, bench_prefill, sized_engine
from pdserve.engine.llm_engine import LLMEngine
from pdserve.modelgen.default_model import resolve_model

IMPLS = ("native", "transformers")


def make_engine(model: str, impl: str, dtype: str, max_batch: int, prompt_len: int, context: int) -> LLMEngine:
    return sized_engine(model, max_batch, prompt_len, context, dtype=dtype, model_impl=impl)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.model_impl", description=__doc__)
    ap.add_argument("--model", default=None, help="a Llama folder (default: the embedded `bench`-preset model)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding sequence")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    engines = {i: make_engine(model, i, args.dtype, max(batches), args.prompt_len, args.context) for i in IMPLS}
    best: dict[tuple[str, str], float] = {}
    rows = [(f"decode batch {b}", b, "decode") for b in batches] + [(f"prefill {args.prompt_len}", 1, "prefill")]
    for _ in range(args.repeats):
        for name, b, kind in rows:
            for impl, engine in engines.items():
                if kind == "decode":
                    tok_s = b / bench_decode(engine, b, args.context, args.decode_steps)
                else:
                    tok_s = args.prompt_len / bench_prefill(engine, 1, args.prompt_len)
                best[name, impl] = max(best.get((name, impl), 0.0), tok_s)
    print(
        f"# {model} ({args.dtype}), torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"{_cpu_name()}, best of {args.repeats}"
    )
    print("| step | native tok/s | transformers tok/s | transformers / native |")
    print("|---|---:|---:|---:|")
    for name, _, _ in rows:
        n, t = best[name, "native"], best[name, "transformers"]
        print(f"| {name} | {n:.0f} | {t:.0f} | {t / n:.2f}x |")
    return 0


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.machine())


if __name__ == "__main__":
    raise SystemExit(main())
