"""`python -m pdserve.bench.prefill_placement`: conditional disaggregation on a mixed load.

The same load (short prompts of 16-64 tokens and long ones of 512-1024, interleaved at random,
Poisson arrivals, every prompt new to the cache) against `pdserve serve` 1P1D under each
`--prefill-placement`: auto (the cost model, gateway/prefill_placement.py), remote (every prompt
through the prefill pool) and local (every prompt on the decode worker). The three servers run
side by side and take the load in rounds, in turn (a shared machine's other jobs fall on all of
them alike). Per placement: mean and p90 TTFT and TPOT, the short prompts' mean TTFT, output
tok/s (over the seconds its segments ran), and how many prompts the decode worker prefilled
itself (from /metrics), in one table. `--one-at-a-time`: each server alone instead, started afresh
per round, the order rotated. Figures: docs/benchmarks/prefill_placement.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import sys
import time
from pathlib import Path

import aiohttp
import httpx

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import build_payload, send
from pdserve.bench.datasets import BenchRequest
from pdserve.bench.metrics import RequestResult, compute_metrics
from pdserve.bench.servers import ServerSpec, free_port, running
from pdserve.gateway.prefill_placement import PREFILL_PLACEMENTS


def mixed_requests(n: int, vocab: int, long_share: float, output_len: int, seed: int) -> list[BenchRequest]:
    """`n` prompts of random token ids, short (16-64) or, with probability `long_share`, long
    (512-1024); each starts differently, so no prompt is cached when it arrives."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(512, 1024) if rng.random() < long_share else rng.randint(16, 64)
        out.append(BenchRequest([rng.randrange(3, vocab) for _ in range(length)], length, output_len))
    return out


async def run_load(base: str, model: str, requests: list[BenchRequest], rate: float, seed: int) -> tuple[list, float]:
    offsets = arrival_offsets(len(requests), rate, seed=seed)
    url = f"{base}/v1/completions"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        start = time.perf_counter()

        async def one(req: BenchRequest, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            payload = build_payload(req, model, url, temperature=0.0, ignore_eos=True)
            return await send(session, url, payload, req)

        results = await asyncio.gather(*(one(r, at) for r, at in zip(requests, offsets)))
        return list(results), time.perf_counter() - start


def metric_sum(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=60).text
    return sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M))


def local_prefills(base: str) -> int:
    return int(metric_sum(base, "pdserve_local_prefills_total"))


def settle(base: str, timeout_s: float = 30.0) -> None:
    """Wait until the server's workers report nothing running or waiting (work a failed request
    left behind must not fall on the next placement's segment)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = metric_sum(base, "pdserve_num_requests_running") + metric_sum(base, "pdserve_num_requests_waiting")
        if busy == 0:
            return
        time.sleep(0.5)


def server_spec(model: str, placement: str, cap: int) -> tuple[ServerSpec, str]:
    port = free_port()
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--model", model, "--dtype", "float32"]
    argv += ["--port", str(port), "--max-model-len", "2048", "--prefill-placement", placement]
    argv += ["--local-prefill-max-tokens", str(cap)]
    return ServerSpec(placement, argv, "/health"), f"http://127.0.0.1:{port}"


def summarize(results: list[RequestResult], requests: list[BenchRequest], duration: float, local: int) -> dict:
    m = compute_metrics(results, duration, percentiles=(90,), selected=("ttft", "tpot"))
    failed = [r.error for r in results if not r.success]
    m["errors"] = failed[:3]
    short = [r for r, q in zip(results, requests) if r.success and q.prompt_len <= 64]
    m["mean_short_ttft_ms"] = 1000 * sum(r.ttft for r in short) / max(1, len(short))
    m["local_prefills"] = local
    return m


def measure_all(model: str, placements: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Every placement's server up at once (idle ones cost a poll loop); the load in `rounds`
    segments of `requests / rounds`, each segment sent to every server in turn, the order rotated
    per round, so the other jobs on a shared machine fall on every placement alike. Each segment
    is new prompts (nothing cached), the same prompts for every placement."""
    per_round = max(1, args.requests // args.rounds)
    results: dict[str, list[RequestResult]] = {p: [] for p in placements}
    sent: dict[str, list[BenchRequest]] = {p: [] for p in placements}
    busy = {p: 0.0 for p in placements}  # seconds of load (the segments' durations)
    with contextlib.ExitStack() as stack:
        bases = {}
        for p in placements:
            spec, base = server_spec(model, p, args.local_prefill_max_tokens)
            stack.enter_context(running(spec, base, Path(f"/tmp/pdserve-placement-{p}.log")))
            bases[p] = base
        name = Path(model).name
        time.sleep(5.0)  # the last server's workers finish starting (their CPU is not a segment's)
        for p in placements:  # first steps, and the rates measured once
            asyncio.run(run_load(bases[p], name, mixed_requests(4, args.vocab, 0.5, 4, args.seed + 999), 4.0, 0))
            settle(bases[p])
        before = {p: local_prefills(bases[p]) for p in placements}
        for r in range(args.rounds):
            segment = mixed_requests(per_round, args.vocab, args.long_share, args.output_len, args.seed + r)
            order = placements[r % len(placements) :] + placements[: r % len(placements)]
            for p in order:
                got, duration = asyncio.run(run_load(bases[p], name, segment, args.rate, args.seed + r))
                results[p] += got
                sent[p] += segment
                busy[p] += duration
                settle(bases[p])
        time.sleep(1.0)  # a heartbeat carries the last counters
        local = {p: local_prefills(bases[p]) - before[p] for p in placements}
    return {p: summarize(results[p], sent[p], busy[p], local[p]) for p in placements}


def measure_one_at_a_time(model: str, placements: list[str], args: argparse.Namespace) -> dict[str, dict]:
    """Each placement's server alone on the machine (no idle server beside it), started, warmed
    and stopped for each of `rounds` segments; the order of placements rotated per round, every
    placement given the same new prompts in a round."""
    per_round = max(1, args.requests // args.rounds)
    results: dict[str, list[RequestResult]] = {p: [] for p in placements}
    sent: dict[str, list[BenchRequest]] = {p: [] for p in placements}
    busy = {p: 0.0 for p in placements}
    local = {p: 0 for p in placements}
    name = Path(model).name
    for r in range(args.rounds):
        segment = mixed_requests(per_round, args.vocab, args.long_share, args.output_len, args.seed + r)
        order = placements[r % len(placements) :] + placements[: r % len(placements)]
        for p in order:
            spec, base = server_spec(model, p, args.local_prefill_max_tokens)
            with running(spec, base, Path(f"/tmp/pdserve-placement-{p}.log"), mode="a"):
                asyncio.run(run_load(base, name, mixed_requests(4, args.vocab, 0.5, 4, args.seed + 999), 4.0, 0))
                settle(base)
                time.sleep(1.0)  # the warm-up's counters arrive with a heartbeat
                before = local_prefills(base)
                got, duration = asyncio.run(run_load(base, name, segment, args.rate, args.seed + r))
                settle(base)
                time.sleep(1.0)  # a heartbeat carries the last counters
                local[p] += local_prefills(base) - before
            results[p] += got
            sent[p] += segment
            busy[p] += duration
            print(f"round {r} {p}: done", file=sys.stderr, flush=True)
    return {p: summarize(results[p], sent[p], busy[p], local[p]) for p in placements}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pdserve.bench.prefill_placement",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="HF model folder (pdserve make-model --preset bench)")
    ap.add_argument("--requests", type=int, default=40, help="per placement, over all rounds")
    ap.add_argument("--rounds", type=int, default=4, help="segments of the load, placements in turn")
    ap.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    ap.add_argument("--long-share", type=float, default=0.25, help="share of long (512-1024 token) prompts")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--local-prefill-max-tokens", type=int, default=128, help="the cap under auto")
    ap.add_argument("--placements", default=",".join(PREFILL_PLACEMENTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the figures here as JSON")
    ap.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="run each placement's server alone, started afresh for each round (no server idles beside another)",
    )
    args = ap.parse_args(argv)
    from transformers import AutoConfig

    args.vocab = AutoConfig.from_pretrained(args.model).vocab_size
    print(
        f"{args.requests} requests per placement in {args.rounds} rounds, {args.long_share:.0%} long, "
        f"{args.rate:g} req/s Poisson, {args.output_len} tokens out",
        flush=True,
    )
    measure = measure_one_at_a_time if args.one_at_a_time else measure_all
    table = measure(args.model, args.placements.split(","), args)
    head = ("placement", "TTFT mean", "TTFT p90", "short TTFT", "TPOT mean", "TPOT p90", "out tok/s", "local")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for p, m in table.items():
        cells = [
            p,
            f"{m['mean_ttft_ms']:.0f} ms",
            f"{m['p90_ttft_ms']:.0f} ms",
            f"{m['mean_short_ttft_ms']:.0f} ms",
            f"{m['mean_tpot_ms']:.1f} ms",
            f"{m['p90_tpot_ms']:.1f} ms",
            f"{m['output_throughput']:.1f}",
            f"{m['local_prefills']}/{m['completed']}",
        ]
        print("| " + " | ".join(cells) + " |")
    for p, m in table.items():
        if m["errors"]:
            print(f"{p}: {m['failed']} failed, e.g. {m['errors'][0]}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
