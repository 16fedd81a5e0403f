"""`python -m pdserve.bench.prefill_overhead`: a prefill worker's CPU per prompt token under
`pdserve serve` (1P1D) against the bare engine step on the same prompts (issue 35, item 2).

Bare: an LLMEngine in this process, on the prefill worker's thread count, prefilling each prompt
alone (`prefill_only`, as a prefill worker does), CPU time from `time.process_time()` (every
thread). Served: the same prompts streamed one at a time through the gateway (`max_tokens` 2, so
the KV is shipped to the decode worker as in real serving); the prefill worker's user + system CPU
from /proc over the run, and each request's time to its first token. Distinct random prompts, so the prefix cache computes every token. The
two alternate round by round; each figure is a round's CPU seconds / prompt tokens, and the
ratio of their medians is printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

from pdserve.bench.server_cpu import session_cpu_by_role
from pdserve.bench.servers import ServerSpec, free_port, running
from pdserve.cli.engine_args import resolve_model
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams


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
            bare.append(
                bare_cpu_per_token(engine, prompts_for(vocab, args.prompts, args.prompt_len, seed=100 + r), f"r{r}")
            )
            print(
                f"round {r}: bare {bare[-1] * 1e3:.3f} ms CPU / prompt token, served {served[-1] * 1e3:.3f} "
                f"({served[-1] / bare[-1]:.2f}x), TTFT median {ttft[-1] * 1e3:.0f} ms",
                flush=True,
            )
    engine.close()
    print(
        f"# {model}, {args.prompt_len}-token prompts one at a time, {args.threads} thread(s): prefill worker CPU / "
        f"bare step CPU = {statistics.median(served) / statistics.median(bare):.3f}x "
        f"(medians {statistics.median(served) * 1e3:.3f} / {statistics.median(bare) * 1e3:.3f} ms a token); "
        f"TTFT median {statistics.median(ttft) * 1e3:.0f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
