"""`python -m pdserve.bench.aimd`: adaptive admission (AIMD, decode_node/aimd.py) against a
too-low and a too-high fixed limit on running sequences, on the same load, one run each.

A 1P1D `pdserve serve` (the bench model, say) whose decode worker has a small KV pool
(`--num-blocks`): with the high fixed limit it admits more sequences than their KV can grow
into and preempts (recomputing whole prompts on its own cores); with the low one its batch sits
under-filled while requests queue at the gateway. The adaptive one moves between the two. The
same Poisson load goes to each (seeded prompts); reported: output tok/s, SLO attainment (TTFT
<= 2 s, TPOT <= 60 ms), TTFT/TPOT, the decode worker's preemptions, and the limit over time
(plot). Results and plot go to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
import threading
import time
from pathlib import Path

import httpx

from pdserve.bench.cli import build_parser, load_requests, run_once
from pdserve.bench.servers import ServerSpec, free_port, running

SLOS = {"ttft": 2000.0, "tpot": 60.0}
PREEMPTIONS = "pdserve_preemptions_total"  # (a counter: its samples carry the _total suffix)


def _decode_gauge(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf'^{name}\{{node="decode[^"]*"\}} ([0-9.e+]+)$', text, re.M))


class LimitTrace:
    """The decode worker's limit on running sequences, read from /metrics every `every_s`."""

    def __init__(self, base: str, every_s: float = 0.5) -> None:
        self.base, self.every_s = base, every_s
        self.points: list[tuple[float, float, float]] = []  # (s since start, limit, running)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LimitTrace:
        self._t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                text = httpx.get(f"{self.base}/metrics", timeout=2).text
            except httpx.HTTPError:
                continue
            self.points.append(
                (
                    time.monotonic() - self._t0,
                    _decode_gauge(text, "pdserve_max_num_seqs"),
                    _decode_gauge(text, "pdserve_num_requests_running"),
                )
            )


def run_config(label: str, flags: list[str], args, tokenizer, out: Path) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--model", args.model, "--port", str(port)]
    argv += ["--dtype", "float32", "--num-blocks", str(args.num_blocks), *flags]
    spec = ServerSpec(label, argv, "/health")
    print(f"== {label}: pdserve serve {' '.join(flags)}", flush=True)
    with running(spec, base, out / f"{label}.log"):
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        bench = build_parser().parse_args(
            [
                "--base-url",
                base,
                "--tokenizer",
                args.model,
                "--disable-tqdm",
                "--num-prompts",
                str(args.num_prompts),
                "--random-input-len",
                str(args.input_len),
                "--random-range-ratio",
                "0.33",
                "--random-output-len",
                str(args.output_len),
                "--ignore-eos",
                "--label",
                label,
            ]
        )
        warm = build_parser().parse_args(
            ["--base-url", base, "--tokenizer", args.model, "--disable-tqdm", "--num-prompts", "4"]
            + ["--random-input-len", "128", "--random-output-len", "16"]
        )
        asyncio.run(run_once(warm, model, tokenizer, load_requests(warm, tokenizer, 99), float("inf"), {}, 99))
        before = httpx.get(f"{base}/metrics", timeout=5).text
        with LimitTrace(base) as trace:
            requests = load_requests(bench, tokenizer, args.seed)
            r = asyncio.run(run_once(bench, model, tokenizer, requests, args.rate, dict(SLOS), args.seed))
        after = httpx.get(f"{base}/metrics", timeout=5).text
    r["preemptions"] = _decode_gauge(after, PREEMPTIONS) - _decode_gauge(before, PREEMPTIONS)
    r["limit_trace"] = trace.points
    r["flags"] = flags
    print(
        f"{label}: {r['output_throughput']:.1f} output tok/s, attainment {r['goodput_attainment']:.0%}, "
        f"median TTFT {r['median_ttft_ms']:.0f} ms, median TPOT {r['median_tpot_ms']:.1f} ms, "
        f"{r['preemptions']:.0f} preemptions, {r['failed']} failed",
        flush=True,
    )
    return r


def plot(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, r in results.items():
        pts = r["limit_trace"]
        if pts:
            ax.plot([p[0] for p in pts], [p[2] for p in pts], label=f"{label}: running")
    adaptive = results.get("adaptive", {}).get("limit_trace", [])
    if adaptive:
        ax.plot([p[0] for p in adaptive], [p[1] for p in adaptive], "k--", label="adaptive: its limit")
    ax.set_xlabel("seconds")
    ax.set_ylabel("sequences on the decode worker")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "limit.png", dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.aimd", description=__doc__)
    ap.add_argument("--model", required=True, help="HF model folder (e.g. `pdserve make-model --preset bench`)")
    ap.add_argument("--out", default="docs/benchmarks/aimd")
    ap.add_argument("--num-blocks", type=int, default=400, help="KV blocks per worker (16 tokens each)")
    ap.add_argument("--low", type=int, default=2, help="the too-low fixed limit (and the adaptive minimum)")
    ap.add_argument("--high", type=int, default=64, help="the too-high fixed limit (and the adaptive maximum)")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=384, help="prompt tokens (+-33%%)")
    ap.add_argument("--output-len", type=int, default=192, help="output tokens (ignore_eos)")
    ap.add_argument("--rate", type=float, default=2.0, help="requests/s, Poisson")
    ap.add_argument("--seed", type=int, default=5)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = {
        f"fixed-{args.low}": ["--max-num-seqs", str(args.low)],
        f"fixed-{args.high}": ["--max-num-seqs", str(args.high)],
        "adaptive": ["--max-num-seqs", str(args.high), "--min-num-seqs", str(args.low)],
    }
    results = {label: run_config(label, flags, args, tokenizer, out) for label, flags in configs.items()}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out)
    print("\n| limit | output tok/s | SLO attainment | median / p90 TTFT (ms) | median / p90 TPOT (ms) | preemptions |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        print(
            f"| {label} | {r['output_throughput']:.1f} | {r['goodput_attainment']:.0%} | "
            f"{r['median_ttft_ms']:.0f} / {r['p90_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} / {r['p90_tpot_ms']:.1f} "
            f"| {r['preemptions']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
