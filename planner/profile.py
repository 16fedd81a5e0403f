"""Time the engine's steps on this machine and fit the planner's cost models (costs.py).

The engine runs in this process, as a worker's would, with the prefix cache off (every token
computed) and the step budget of a CPU prefill worker (512 tokens): prompts of 64 to 2048 tokens
alone and four at once (chunked steps at growing contexts), then decode steps of 1 to 32
sequences at 128 and 512 tokens of context. Each configuration is timed at every thread count
asked for (default: 1 and all cores), each step the best of `repeats`. Transfer bandwidth: this
machine's memcpy (shared-memory KV is a copy into the decode worker's pool).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import torch

from pdserve.bench.machine import measure_memcpy_gbps
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.planner.costs import CostModel, ThreadCosts, fit
from pdserve.protocol.sampling import SamplingParams

PREFILL_BUDGET = 512  # a CPU prefill worker's step (cli/topology.py CPU_PREFILL_BUDGET)
PROMPT_LENS = (64, 128, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 2, 4, 8, 16, 32)
DECODE_CONTEXTS = (128, 512)


def _cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _engine(model: str) -> LLMEngine:
    blocks = (max(DECODE_BATCHES) * (max(DECODE_CONTEXTS) + 64)) // 16 + 64
    return LLMEngine(
        EngineConfig(
            model=model,
            dtype="float32",
            cache=CacheConfig(num_blocks=max(blocks, 4 * 2048 // 16 + 64), enable_prefix_caching=False),
            scheduler=SchedulerConfig(
                max_num_seqs=max(DECODE_BATCHES),
                max_num_batched_tokens=PREFILL_BUDGET,
                max_model_len=max(max(PROMPT_LENS), max(DECODE_CONTEXTS)) + 64,
            ),
        )
    )


def _prompt(engine: LLMEngine, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, engine.model_config.vocab_size, (n,), generator=g).tolist()


def _timed_steps(engine: LLMEngine) -> list[tuple[float, int, float, int, int]]:
    """Run the engine dry; per step: (seconds, prefill tokens, attention pairs, decodes, context)."""
    out = []
    while engine.has_work():
        sched = engine.schedule()
        tokens = sum(c.num_tokens for c in sched.prefills)
        pairs = sum(c.num_tokens * (c.seq.num_computed_tokens + c.num_tokens / 2) for c in sched.prefills)
        context = sum(c.seq.num_tokens for c in sched.decodes)
        t0 = time.perf_counter()
        engine.execute(sched)
        out.append((time.perf_counter() - t0, tokens, pairs, len(sched.decodes), context))
    return out


def _prefill_points(engine: LLMEngine, repeats: int) -> tuple[list[tuple[float, float]], list[float]]:
    greedy = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    fits = [n for n in PROMPT_LENS if n < engine.max_model_len - 1]  # (a small model's context may be short)
    shapes = [[n] for n in fits] + [[128] * 4, [256] * 4]
    best: dict[tuple[int, float], float] = {}
    for r in range(repeats):
        for k, lens in enumerate(shapes):
            for i, n in enumerate(lens):
                engine.add_request(f"p{r}-{k}-{i}", _prompt(engine, n, 100 * k + i), greedy)
            for dt, tokens, pairs, _, _ in _timed_steps(engine):
                key = (tokens, round(pairs))
                best[key] = min(dt, best.get(key, float("inf")))
    rows = [(float(t), float(p)) for t, p in best]
    return rows, list(best.values())


def _decode_points(engine: LLMEngine, repeats: int, steps: int = 6) -> tuple[list[tuple[float, float]], list[float]]:
    rows, times = [], []
    for batch in DECODE_BATCHES:
        for ctx in (c for c in DECODE_CONTEXTS if c + steps * repeats + 2 < engine.max_model_len):
            sp = SamplingParams(max_tokens=steps * repeats + 2, temperature=0.0, ignore_eos=True)
            for i in range(batch):
                engine.add_request(f"d{batch}-{ctx}-{i}", _prompt(engine, ctx, 7 * i + batch), sp)
            measured = [s for s in _timed_steps(engine) if s[1] == 0 and s[3] == batch]
            if measured:
                rows.append((float(batch), float(statistics.median(s[4] for s in measured))))
                times.append(min(s[0] for s in measured))
    return rows, times


def profile(
    model: str, threads: list[int] | None = None, repeats: int = 2, progress: Callable[[str], None] = print
) -> CostModel:
    threads = threads or sorted({1, os.cpu_count() or 1})
    before = torch.get_num_threads()
    engine = _engine(model)
    by_threads = {}
    try:
        for t in threads:
            torch.set_num_threads(t)
            progress(f"profile: prefill steps on {t} thread(s)")
            p_rows, p_times = _prefill_points(engine, repeats)
            progress(f"profile: decode steps on {t} thread(s)")
            d_rows, d_times = _decode_points(engine, repeats)
            by_threads[t] = ThreadCosts(prefill=fit(p_rows, p_times), decode=fit(d_rows, d_times))
            c = by_threads[t]
            progress(
                f"  {t} thread(s): prefill {c.prefill.intercept * 1e3:.2f} ms + {c.prefill.coefs[0] * 1e6:.1f} us/token "
                f"(rms {c.prefill.rms_error_s * 1e3:.1f} ms); decode {c.decode.intercept * 1e3:.2f} ms + "
                f"{c.decode.coefs[0] * 1e3:.2f} ms/sequence (rms {c.decode.rms_error_s * 1e3:.2f} ms)"
            )
    finally:
        torch.set_num_threads(before)
    progress("profile: memcpy bandwidth")
    return CostModel(
        model=model,
        machine=_cpu_name(),
        block_size=engine.block_size,
        kv_bytes_per_token=engine.kv_spec.bytes_per_block // engine.block_size,
        num_layers=engine.model_config.num_layers,
        transfer_gbps=measure_memcpy_gbps(),
        by_threads=by_threads,
    )
