"""Batch-1 decode steps of a GGUF file with fp32 and with int8 activations (--activation-quantization
none / int8: kernels/cpu_quant_gemm.c / cpu_quant_dot.c), each in a fresh process, beside llama.cpp's
own `llama-bench` on the same file and thread count when its path is given.

    python -m pdserve.bench.activation_quantization --model FILE.gguf [--threads 1] [--steps 16]
        [--llama-bench PATH/llama-bench]

Prints wall and CPU milliseconds per token for each. CPU time is the figure to trust on a shared
machine (other processes stretch the wall time, not the CPU time, of a memory-bound step); llama.cpp's
is the CPU time of a run of 8 + `--steps` tokens less that of a run of 8 (its load and warm-up cancel).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from pdserve.bench.thread_waits import STEP  # one batch-1 decode run in a fresh process


def pdserve_run(model: str, threads: int, steps: int, activations: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", STEP, model, str(threads), str(steps), activations], capture_output=True, text=True
    )
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _llama_bench_run(binary: str, model: str, threads: int, tokens: int) -> tuple[float, float]:
    """(CPU seconds of the whole process, its own mean generation wall ms per token)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    argv = [binary, "-m", model, "-t", str(threads), "-p", "0", "-n", str(tokens), "-r", "1", "-o", "json"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    tok_per_s = json.loads(out.stdout)[0]["avg_ts"]
    return cpu, 1e3 / tok_per_s


def llama_bench(binary: str, model: str, threads: int, steps: int) -> dict:
    base_cpu, _ = _llama_bench_run(binary, model, threads, 8)
    cpu, wall_ms = _llama_bench_run(binary, model, threads, 8 + steps)
    return {"wall_ms": wall_ms, "cpu_ms": 1e3 * (cpu - base_cpu) / steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pdserve.bench.activation_quantization", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--llama-bench", help="llama.cpp's llama-bench binary: measured on the same file")
    args = ap.parse_args(argv)
    print(f"{args.model}: batch 1, {args.threads} thread(s), {args.steps} tokens a run ({time.strftime('%Y-%m-%d')})")
    rows = {f"pdserve {a}": pdserve_run(args.model, args.threads, args.steps, a) for a in ("none", "int8")}
    if args.llama_bench:
        rows["llama.cpp"] = llama_bench(args.llama_bench, args.model, args.threads, args.steps)
    ref = rows.get("llama.cpp")
    ceiling, weights = read_ceiling_gbps(args.threads), weight_bytes_per_token(args.model)
    print(
        f"read ceiling ({args.threads} thread(s), this run): {ceiling:.1f} GB/s; weights read a token: {weights / 1e6:.0f} MB"
    )
    print(
        f"{'':16s} {'wall ms/token':>13s} {'cpu ms/token':>13s}  {'GB/s (wall)':>11s}  {'/ ceiling':>9s}"
        + ("  cpu / llama.cpp's" if ref else "")
    )
    for name, r in rows.items():
        ratio = f"  {r['cpu_ms'] / ref['cpu_ms']:.2f}x" if ref else ""
        gbps = weights / r["wall_ms"] / 1e6
        print(f"{name:16s} {r['wall_ms']:13.1f} {r['cpu_ms']:13.1f}  {gbps:11.1f}  {gbps / ceiling:9.2f}{ratio}")
    return 0


def read_ceiling_gbps(threads: int) -> float:
    """A plain read of 1 GiB (torch's sum) at the bench's thread count: a memory-bound step's ceiling."""
    import torch

    from pdserve.bench.machine import measure_read_gbps

    torch.set_num_threads(threads)
    return measure_read_gbps(1 << 30)


def weight_bytes_per_token(model: str) -> int:
    """Bytes of the file's weights a batch-1 decode step reads: every tensor but the embedding
    table (one row of it), which is read whole as the LM head when the file has no output tensor,
    and of a mixture's stacked experts only the k of E a token is routed to."""
    from pdserve.engine.gguf_file import metadata
    from pdserve.engine.gguf_reader import GgufFile

    f = GgufFile(model)
    arch = metadata(f, "general.architecture")
    used, experts = metadata(f, f"{arch}.expert_used_count", 1), metadata(f, f"{arch}.expert_count", 1)
    tensors = {t.name: t.data.nbytes * (used / experts if t.name.endswith("_exps.weight") else 1) for t in f.tensors}
    table = tensors.pop("token_embd.weight", 0)
    return int(sum(tensors.values()) + (0 if "output.weight" in tensors else table))


if __name__ == "__main__":
    raise SystemExit(main())
