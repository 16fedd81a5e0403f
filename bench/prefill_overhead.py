"""`python -m pdserve.bench.prefill_overhead`: a prefill worker's CPU per prompt token under
`pdserve serve` (1P1D) against the bare engine step on the same prompts.

Bare: an LLMEngine in this process, on the prefill worker's thread count, prefilling each prompt
alone (`prefill_only`, as a prefill worker does; glibc's heap tuned as the worker's), CPU time
from `time.process_time()` (every thread). Served: the same prompts streamed one at a time through the gateway (`max_tokens` 2, so
the KV is shipped to the decode worker as in real serving); the prefill worker's user + system CPU
from /proc over the run, and each request's time to its first token. Distinct random prompts, so the prefix cache computes every token. The
two alternate round by round; each figure is a round's CPU seconds / prompt tokens, and the
ratio of their medians is printed. Beside it, the time a prompt's FLOPs need at the matmul rate
measured in this run on the prefill worker's threads (decoder-layer linears, 2 x params a token,
plus causal attention), against the served TTFT (a lone 600-token prompt's TTFT vs its
FLOP time: `--prompt-len 600`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

from pdserve.bench.engine_throughput import attention_flops_per_prompt
from pdserve.bench.machine import measure_matmul_gflops
from pdserve.bench.server_cpu import session_cpu_by_role
from pdserve.bench.servers import ServerSpec, free_port, running
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.llama import LlamaForCausalLM
from pdserve.modelgen.default_model import resolve_model
from pdserve.protocol.sampling import SamplingParams
from pdserve.worker_process import configure_worker_process


def prompts_for(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=g).tolist()


def bare_cpu_per_token(engine: LLMEngine, prompts: list[list[int]], tag: str) -> float:
    sp = SamplingParams(max_tokens=1, temperature=0.0)
    t0 = time.process_time()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, sp, prefill_only=True)
        while engine.has_work():
            engine.step()
    return (time.process_time() - t0) / sum(map(len, prompts))


def served_cpu_per_token(base: str, model: str, sid: int, prompts: list[list[int]]) -> tuple[float, float]:
    """(the prefill worker's CPU seconds a prompt token, the median seconds to the first token)."""
    ttfts = []
    with httpx.Client(timeout=600) as client:
        before = session_cpu_by_role(sid).get("prefill", 0.0)
        for p in prompts:
            body = {"model": model, "prompt": p, "max_tokens": 2, "temperature": 0, "stream": True}
            t0 = time.perf_counter()
            first = None
            with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():  # read to the end: the request's KV shipped and done
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - t0
            assert first is not None, "no token streamed"
            ttfts.append(first)
        after = session_cpu_by_role(sid).get("prefill", 0.0)
    return (after - before) / sum(map(len, prompts)), statistics.median(ttfts)


def prompt_flops(engine: LLMEngine, prompt_len: int) -> int:
    """A prompt's FLOPs: the decoder layers' linears (2 x params a token) and causal attention."""
    mc = engine.model_config
    with torch.device("meta"):  # the dense model's counts (CPU layouts may hold extra weight copies)
        dense = LlamaForCausalLM(mc, 16)
    params = sum(p.numel() for n, p in dense.named_parameters() if not n.startswith(("embed_tokens", "lm_head")))
    return 2 * params * prompt_len + attention_flops_per_prompt(mc, prompt_len)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.prefill_overhead", description=__doc__)
    ap.add_argument("--model", default=None, help="model folder (default: the embedded model)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=8, help="prompts a round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--threads", type=int, default=1, help="the prefill worker's torch threads (serve: cores / workers)"
    )
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `pdserve serve` argument (repeatable)")
    ap.add_argument("--log", default="/tmp/pdserve-prefill-overhead.log")
    args = ap.parse_args(argv)
    model = resolve_model(args.model)
    configure_worker_process()  # the bare engine allocates (and copies) as the worker does
    torch.set_num_threads(args.threads)
    engine = LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            cache=CacheConfig(block_size=16, num_blocks=4 * (args.prompt_len // 16 + 2)),
            scheduler=SchedulerConfig(max_num_batched_tokens=512, max_model_len=args.prompt_len + 16),
        ),
        show_progress=False,
    )
    vocab = engine.model_config.vocab_size
    port = free_port()
    argv_serve = [sys.executable, "-m", "pdserve.cli", "serve", "--model", model, "--dtype", "float32"]
    spec = ServerSpec("pdserve-1P1D", argv_serve + ["--port", str(port), *args.serve_arg], "/health")
    base = f"http://127.0.0.1:{port}"
    bare: list[float] = []
    served: list[float] = []
    ttft: list[float] = []
    matmul: list[float] = []  # GFLOP/s on the prefill worker's threads, measured each round
    machine: list[float] = []  # GFLOP/s on every core (a lone prompt's chunks may take the idle lane too)
    flops = prompt_flops(engine, args.prompt_len)
    with running(spec, base, Path(args.log)) as proc:
        name = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        warm = prompts_for(vocab, 2, args.prompt_len, seed=1000)
        served_cpu_per_token(base, name, proc.pid, warm)  # untimed: first steps, C kernels built
        bare_cpu_per_token(engine, warm, "warm")
        for r in range(args.rounds):
            prompts = prompts_for(vocab, args.prompts, args.prompt_len, seed=r)
            cpu, first = served_cpu_per_token(base, name, proc.pid, prompts)
            served.append(cpu)
            ttft.append(first)
            matmul.append(measure_matmul_gflops())
            torch.set_num_threads(os.cpu_count() or 1)
            machine.append(measure_matmul_gflops())
            torch.set_num_threads(args.threads)
            bare.append(
                bare_cpu_per_token(engine, prompts_for(vocab, args.prompts, args.prompt_len, seed=100 + r), f"r{r}")
            )
            print(
                f"round {r}: bare {bare[-1] * 1e3:.3f} ms CPU / prompt token, served {served[-1] * 1e3:.3f} "
                f"({served[-1] / bare[-1]:.2f}x), TTFT median {ttft[-1] * 1e3:.0f} ms, FLOP time "
                f"{flops / matmul[-1] / 1e6:.0f} ms at {matmul[-1]:.0f} GFLOP/s ({flops / machine[-1] / 1e6:.0f} ms at "
                f"{machine[-1]:.0f} on every core)",
                flush=True,
            )
    engine.close()
    flop_s = flops / (statistics.median(matmul) * 1e9)
    flop_all = flops / (statistics.median(machine) * 1e9)
    print(
        f"# {model}, {args.prompt_len}-token prompts one at a time, {args.threads} thread(s): prefill worker CPU / "
        f"bare step CPU = {statistics.median(served) / statistics.median(bare):.3f}x "
        f"(medians {statistics.median(served) * 1e3:.3f} / {statistics.median(bare) * 1e3:.3f} ms a token); "
        f"TTFT median {statistics.median(ttft) * 1e3:.0f} ms = {statistics.median(ttft) / flop_s:.2f}x the prompt's "
        f"FLOP time ({flops / 1e9:.1f} GFLOP at a median {statistics.median(matmul):.0f} GFLOP/s: {flop_s * 1e3:.0f} ms), "
        f"{statistics.median(ttft) / flop_all:.2f}x at every core's {statistics.median(machine):.0f} GFLOP/s "
        f"({flop_all * 1e3:.0f} ms)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
