"""A long prefix computed on one prefill worker, used by another: fetched over the KV plane
against computed again. `python -m pdserve.bench.prefix_fetch --model DIR`.

2P1D, requests dealt round-robin, so of each pair of requests sharing a --prefix-token prefix
(different --tail tokens after it) the first is computed on prefill worker A and the second goes
to B. Two servers, one after the other, same flags:

    recompute   --no-prefix-sharing: B computes the whole prefix again
    fetch       the default: the gateway names A in B's request, B fetches the prefix's blocks

TTFT of the second requests (streamed, first token's arrival): median, and fetch / recompute as a
ratio; the fetch counters from /metrics. The second requests' greedy answers are compared across
the two servers (the KV fetched is the KV computed)."""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.bench.kv_disk_tier import OUT_TOKENS, first_token_time, timed_completion
from pdserve.bench.servers import ServerSpec, free_port, running

FLAGS = ["--prefill-workers", "2", "--router", "round-robin", "--local-prefill-max-tokens", "0"]


def counters(base: str, prefix: str) -> dict[str, float]:
    """/metrics samples starting with `prefix`, summed over workers."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_for_prefill_workers(base: str, n: int, timeout_s: float = 600) -> None:
    """/health answers 200 with one worker per pool; round-robin pairs need both prefill workers."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{base}/health", timeout=5).json().get("live_workers", {}).get("prefill", 0) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"fewer than {n} prefill workers joined")
        time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF folder (e.g. `pdserve make-model --preset real`)")
    ap.add_argument("--pairs", type=int, default=4, help="prefixes, each computed on A then used on B")
    ap.add_argument("--prefix", type=int, default=1984, help="tokens of the shared prefix")
    ap.add_argument("--tail", type=int, default=32, help="tokens after it, different in each request")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = ap.parse_args(argv)

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    prefixes = [tokens(args.prefix) for _ in range(args.pairs)]
    tails = [(tokens(args.tail), tokens(args.tail)) for _ in range(args.pairs)]
    max_len = args.prefix + args.tail + OUT_TOKENS + args.block_size
    blocks = 2 * args.pairs * -(-max_len // args.block_size) + 64  # nothing evicted
    folder = Path(tempfile.mkdtemp(prefix="pdserve-prefix-fetch-"))
    print(f"{args.pairs} pairs, prefix {args.prefix} + tail {args.tail} tokens; logs in {folder}", flush=True)
    common = [
        *(sys.executable, "-m", "pdserve.cli", "serve", "--model", args.model, "--dtype", "float32"),
        *("--num-blocks", str(blocks), "--max-model-len", str(max_len), "--block-size", str(args.block_size)),
        *FLAGS,
    ]
    results: dict[str, dict] = {}
    answers: dict[str, list[str]] = {}
    for label, extra in (("recompute", ["--no-prefix-sharing"]), ("fetch", [])):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        spec = ServerSpec(label, [*common, *extra, "--port", str(port)], "/health")
        print(f"{label}: starting 2P1D", flush=True)
        with running(spec, base, folder / f"{label}.log"), httpx.Client() as client:
            wait_for_prefill_workers(base, 2)
            for warm in (tokens(32), tokens(32)):  # one short prompt on each prefill worker
                first_token_time(client, base, warm)
            firsts, seconds, fetch_s, compute_s, answers[label] = [], [], [], [], []
            for i, (prefix, (tail_a, tail_b)) in enumerate(zip(prefixes, tails)):
                ttft_a, _ = first_token_time(client, base, prefix + tail_a)  # computed on A
                time.sleep(1.2)  # A's heartbeats tell the gateway what it holds now
                ttft_b, answer, timings = timed_completion(client, base, prefix + tail_b)  # B: fetched or computed
                firsts.append(ttft_a)
                seconds.append(ttft_b)
                fetch_s.append(timings.get("prefix_fetch_s", 0.0))
                compute_s.append(timings.get("prefill_compute_s", 0.0))
                answers[label].append(answer)
                print(
                    f"  {label} pair {i + 1}/{args.pairs}: A computes {len(prefix + tail_a)} tokens: TTFT "
                    f"{ttft_a * 1e3:.0f} ms; B: TTFT {ttft_b * 1e3:.0f} ms (fetch {fetch_s[-1] * 1e3:.0f} ms, "
                    f"compute {compute_s[-1] * 1e3:.0f} ms)",
                    flush=True,
                )
            time.sleep(1.5)  # heartbeats carry the last counters
            results[label] = {
                "ttft_b_median_s": statistics.median(seconds),
                "ttft_b_s": seconds,
                "ttft_a_s": firsts,
                "b_prefix_fetch_s": fetch_s,
                "b_prefill_compute_s": compute_s,
                **counters(base, "pdserve_prefix_"),
                **counters(base, "pdserve_prefix_cache_hits"),
            }
    same = answers["recompute"] == answers["fetch"]
    ratio = results["fetch"]["ttft_b_median_s"] / results["recompute"]["ttft_b_median_s"]
    print("\n| server | B's TTFT (median) | / recomputing | blocks fetched | bytes fetched | fetch failures |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, r in results.items():
        print(
            f"| {label} | {r['ttft_b_median_s'] * 1e3:.0f} ms | {r['ttft_b_median_s'] / results['recompute']['ttft_b_median_s']:.3f} "
            f"| {r.get('pdserve_prefix_fetch_blocks_total', 0):.0f} | {r.get('pdserve_prefix_fetch_bytes_total', 0):.0f} "
            f"| {r.get('pdserve_prefix_fetch_failures_total', 0):.0f} |"
        )
    print(f"\nfetched / recomputed TTFT on B: {ratio:.3f}; greedy answers equal on both servers: {same}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"args": {k: str(v) for k, v in vars(args).items()}, "ratio": ratio, "same": same, "results": results}
        args.out.write_text(json.dumps(record, indent=2))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
