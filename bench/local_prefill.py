"""`python -m pdserve.bench.local_prefill`: where conditional disaggregation pays.

A 1P1D server (bench model by default) under a steady decode load (`--background` streams of
long outputs); a conversation's next turn adds `k` new tokens to a prompt the decode worker
holds. For each k, the next turn's TTFT and the background streams' TPOT meanwhile, with the
turn prefilled on the decode worker (--local-prefill-max-tokens high) and through the prefill
pool (0), side by side in one run. The default threshold is the largest k where the local
turn's TTFT is at least --min-gain lower and the background's TPOT stays within --tpot-slack
of the pool's.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from pdserve.bench.servers import ServerSpec, free_port, running


def _stream(base: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT, token arrival times) of one streamed completion."""
    t0 = time.perf_counter()
    arrivals: list[float] = []
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                    arrivals.append(time.perf_counter())
    return (arrivals[0] - t0 if arrivals else float("nan")), arrivals


def measure(base: str, model: str, vocab: int, ks: list[int], background: int, rounds: int, seed: int) -> dict:
    rng = random.Random(seed)
    stop = threading.Event()
    gaps: list[float] = []  # background inter-token gaps (s) while turns run
    measuring = threading.Event()

    def load() -> None:
        while not stop.is_set():
            _, arrivals = _stream(base, model, [rng.randrange(3, vocab) for _ in range(64)], 200)
            if measuring.is_set():
                gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))

    threads = [threading.Thread(target=load, daemon=True) for _ in range(background)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    out = {}
    for k in ks:
        ttfts = []
        gaps.clear()
        measuring.set()
        for _ in range(rounds):
            first = [rng.randrange(3, vocab) for _ in range(320)]
            _stream(base, model, first, 16)
            time.sleep(1.2)  # heartbeats: the gateway learns what the decode worker holds
            ttft, _ = _stream(base, model, first + [rng.randrange(3, vocab) for _ in range(k)], 8)
            ttfts.append(ttft)
        measuring.clear()
        out[k] = {"ttft_median_s": statistics.median(ttfts), "background_tpot_median_s": statistics.median(gaps)}
    stop.set()
    for t in threads:
        t.join(timeout=60)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pdserve.bench.local_prefill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--model", required=True, help="HF model folder (e.g. the bench model)")
    ap.add_argument("--ks", default="16,32,64,128,256", help="new tokens in the next turn")
    ap.add_argument("--background", type=int, default=4, help="long streams decoding meanwhile")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tpot-slack", type=float, default=0.2, help="background TPOT may rise by this share")
    ap.add_argument("--min-gain", type=float, default=0.25, help="the local turn's TTFT must be this share lower")
    ap.add_argument("--out", default=None, help="write the figures here as JSON")
    args = ap.parse_args(argv)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    ks = [int(k) for k in args.ks.split(",")]
    results = {}
    for label, limit in (("pool", 0), ("local", 100000)):
        port = free_port()
        spec = ServerSpec(
            label,
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "serve",
                "--model",
                args.model,
                "--port",
                str(port),
                "--local-prefill-max-tokens",
                str(limit),
            ],
            ready_path="/health",
        )
        with running(spec, f"http://127.0.0.1:{port}", Path(f"/tmp/pdserve-local-prefill-{label}.log")):
            results[label] = measure(
                f"http://127.0.0.1:{port}", Path(args.model).name, vocab, ks, args.background, args.rounds, seed=7
            )
    print(f"{'k':>5} {'TTFT pool':>10} {'TTFT local':>11} {'TPOT pool':>10} {'TPOT local':>11}")
    best = 0
    for k in ks:
        p, loc = results["pool"][k], results["local"][k]
        print(
            f"{k:>5} {p['ttft_median_s'] * 1000:>8.1f}ms {loc['ttft_median_s'] * 1000:>9.1f}ms "
            f"{p['background_tpot_median_s'] * 1000:>8.1f}ms {loc['background_tpot_median_s'] * 1000:>9.1f}ms"
        )
        faster = loc["ttft_median_s"] <= p["ttft_median_s"] * (1 - args.min_gain)
        if faster and loc["background_tpot_median_s"] <= p["background_tpot_median_s"] * (1 + args.tpot_slack):
            best = k
    print(
        f"largest k where the local turn's TTFT is >= {args.min_gain:.0%} lower and the background "
        f"TPOT within {args.tpot_slack:.0%}: {best}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
