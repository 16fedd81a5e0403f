"""`python -m pdserve.bench.tensor_parallel`: tokens/s of a TP=2 engine (two processes, threads/2
torch threads each, each rank on cores of its own; and unpinned) against TP=1 (one process, all
threads; and, for reference, TP=1 on threads/2), on one model folder: decode at batch 1 and 16
and a 512-token prefill. The engines live in this process (a TP=2 engine's second rank idles on
its pipe while another runs; this process is re-pinned to each engine's rank-0 cores before its
run); the runs alternate, each figure the best of --repeats, so background load hits all alike.

`--allreduce HIDDEN` times one all-reduce of [rows, HIDDEN] fp32 between two processes (the cost
each of a step's 2 x layers + 1 collectives pays), instead of the engines.

`--real-shape DIR` makes (once) and measures SmolLM-135M's shape (30 layers, hidden 576, vocab
49152, MLP 1536) with its 9x64 q heads / 3x64 KV heads as 12x48 / 4x48 -- the same linear
shapes, split evenly over 2 ranks (9 heads are not).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from pdserve.bench.engine_throughput import bench_decode, bench_prefill, sized_engine
from pdserve.bench.model_impl import _cpu_name
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.parallel.core_sets import pin
from pdserve.engine.parallel.group import TensorParallelGroup, host_store, join_store
from pdserve.engine.parallel.shard import TensorParallelShard
from pdserve.env import reload as reload_env
from pdserve.modelgen.default_model import resolve_model

ALLREDUCE_ITERS = 2000


def make_engine(model: str, tp: int, max_batch: int, prompt_len: int, context: int) -> LLMEngine:
    return sized_engine(model, max_batch, prompt_len, context, dtype="float32", tensor_parallel_size=tp)


def real_shape_model(folder: Path) -> str:
    from pdserve.modelgen.make_model import make_model

    return str(make_model(folder, preset="real", arch="llama", seed=3, quiet=True, num_heads=12, num_kv_heads=4))


def allreduce_micros(hidden: int, rows: int, peer_port: int | None = None) -> float:
    """Median microseconds of one all-reduce of [rows, hidden] fp32 over two processes (rank 0
    starts rank 1 as `--allreduce-peer PORT`); 0 on rank 1."""
    torch.set_num_threads(1)
    x = torch.ones(rows, hidden)  # [R, H]
    if peer_port is not None:
        group = TensorParallelGroup(TensorParallelShard(1, 2), join_store(peer_port, 2, 60), 60)
        for _ in range(ALLREDUCE_ITERS + 100):
            group.all_reduce(x)
        return 0.0
    store = host_store(2, 60)
    argv = [sys.executable, "-m", "pdserve.bench.tensor_parallel", "--allreduce", str(hidden)]
    peer = subprocess.Popen(argv + ["--rows", str(rows), "--allreduce-peer", str(store.port)])
    group = TensorParallelGroup(TensorParallelShard(0, 2), store, 60)
    times = []
    for i in range(ALLREDUCE_ITERS + 100):
        t0 = time.perf_counter()
        group.all_reduce(x)
        if i >= 100:
            times.append(time.perf_counter() - t0)
    peer.wait()
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.tensor_parallel", description=__doc__)
    ap.add_argument("--model", default=None, help="a model folder (default: the embedded `bench`-preset model)")
    ap.add_argument("--real-shape", default=None, metavar="DIR", help="make (once) and measure the real-shape model")
    ap.add_argument("--threads", type=int, default=2, help="torch threads in all: TP=1 gets them, TP=2 half each")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=128, help="prompt tokens of each decoding sequence")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--allreduce", type=int, default=None, metavar="HIDDEN")
    ap.add_argument("--rows", type=int, default=1, help="with --allreduce: rows of the tensor")
    ap.add_argument("--allreduce-peer", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.allreduce is not None:
        micros = allreduce_micros(args.allreduce, args.rows, args.allreduce_peer)
        if args.allreduce_peer is None:
            print(f"all-reduce [{args.rows}, {args.allreduce}] fp32, 2 processes: median {micros:.0f} us")
        return 0
    model = real_shape_model(Path(args.real_shape)) if args.real_shape else resolve_model(args.model)
    batches = [int(b) for b in args.batches.split(",")]
    half = max(1, args.threads // 2)
    # (engine, torch threads of each rank): TP=1 on all threads and on half; TP=2 with its ranks on
    # cores of their own (core_sets.py), and unpinned (PDSERVE_TP_CORES=off) for comparison
    runs = [("TP=1", args.threads), ("TP=1", half), ("TP=2", half), ("TP=2 unpinned", half)]
    engines: dict[str, LLMEngine] = {}
    cores: dict[str, list[int]] = {}  # this process's cores while running each engine (rank 0's)
    everywhere = sorted(os.sched_getaffinity(0))
    for name, tp, pinned in (("TP=1", 1, True), ("TP=2", 2, True), ("TP=2 unpinned", 2, False)):
        os.environ["PDSERVE_TP_CORES"] = "auto" if pinned else "off"
        reload_env()
        torch.set_num_threads(args.threads)  # TP=2 divides what it finds
        engines[name] = make_engine(model, tp, max(batches), args.prompt_len, args.context)
        cores[name] = sorted(os.sched_getaffinity(0))
        pin(everywhere)  # the next engine starts from every core; each run re-pins rank 0 below
    best: dict[tuple[str, tuple[str, int]], float] = {}
    rows = [(f"decode batch {b}", b, "decode") for b in batches] + [(f"prefill {args.prompt_len}", 1, "prefill")]
    try:
        for _ in range(args.repeats):
            for name, b, kind in rows:
                for run in runs:
                    engine = engines[run[0]]
                    pin(cores[run[0]])
                    torch.set_num_threads(run[1])  # rank 0's; TP=2's rank 1 has its own
                    if kind == "decode":
                        tok_s = b / bench_decode(engine, b, args.context, args.decode_steps)
                    else:
                        tok_s = args.prompt_len / bench_prefill(engine, 1, args.prompt_len)
                    best[name, run] = max(best.get((name, run), 0.0), tok_s)
    finally:
        for engine in engines.values():
            engine.close()
        pin(everywhere)
    print(
        f"# {model} (float32), torch {torch.__version__}, {args.threads} threads in all, {_cpu_name()}, "
        f"best of {args.repeats}"
    )
    print("# rank 0's cores: " + ", ".join(f"{name} {c}" for name, c in cores.items()))
    heads = " | ".join(f"{name} x {t} thread{'s' if t > 1 else ''}, tok/s" for name, t in runs)
    print(f"| step | {heads} | TP=2 / TP=1 x {args.threads} |")
    print("|---|" + "---:|" * (len(runs) + 1))
    for name, _, _ in rows:
        figures = [best[name, run] for run in runs]
        print(f"| {name} | " + " | ".join(f"{f:.1f}" for f in figures) + f" | {figures[2] / figures[0]:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
