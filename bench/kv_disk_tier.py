"""The prefix cache's disk tier against recomputing, on conversations whose KV is several times
the RAM pool: `python -m pdserve.bench.kv_disk_tier --model DIR`.

Each of --conversations conversations has a first turn of --history tokens; its second turn sends
that prompt, the answer and --user new tokens. All first turns run, one at a time, then all
second turns: with a RAM pool of --pool-fraction of the conversations' KV, a conversation's
blocks have left RAM by the time it returns. Three servers, one after the other, same flags:

    recompute   no disk tier: a returning turn computes its whole prompt again
    disk        --kv-offload-dir: the returning turn's history comes back from disk
    restarted   the disk server's folder, every process new: second turns only

TTFT of the second turns (streamed, first token's arrival), median, and each server's as a ratio
to recomputing, side by side; the tier's counters from /metrics. Greedy answers are compared
across the three (the KV read back is the KV computed)."""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from pdserve.bench.servers import ServerSpec, free_port, running

OUT_TOKENS = 8
MODE_FLAGS = {
    "colocated": ["--colocated"],
    "1P1D": ["--local-prefill-max-tokens", "0"],
    "2P1D": ["--prefill-workers", "2", "--router", "round-robin", "--local-prefill-max-tokens", "0"],
}


def timed_completion(client: httpx.Client, base: str, prompt: list[int]) -> tuple[float, str, dict[str, float]]:
    """(TTFT in seconds, the whole greedy answer, the workers' `pdserve_timings`) of one streamed
    completion."""
    body = {"model": model_name(base), "prompt": prompt, "max_tokens": OUT_TOKENS, "temperature": 0, "stream": True}
    t0, ttft, text = time.perf_counter(), None, []
    timings: dict[str, float] = {}
    with client.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            piece = chunk["choices"][0]["text"] if chunk.get("choices") else ""
            if ttft is None and piece:
                ttft = time.perf_counter() - t0
            text.append(piece)
            timings = chunk.get("pdserve_timings") or timings
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(text), timings


def first_token_time(client: httpx.Client, base: str, prompt: list[int]) -> tuple[float, str]:
    """(TTFT in seconds, the whole greedy answer) of one streamed completion."""
    ttft, text, _ = timed_completion(client, base, prompt)
    return ttft, text


@functools.cache
def model_name(base: str) -> str:
    return httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]


def tier_counters(base: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("pdserve_kv_disk_") and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="an HF folder (e.g. `pdserve make-model --preset real`)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--history", type=int, default=1024, help="tokens of a conversation's first turn")
    ap.add_argument("--user", type=int, default=32, help="new tokens of its second turn")
    ap.add_argument("--pool-fraction", type=float, default=0.25, help="the RAM pool, as a share of all their KV")
    ap.add_argument(
        "--mode",
        choices=["colocated", "1P1D", "2P1D"],
        default="colocated",
        help="2P1D deals requests round-robin, each conversation's return to the prefill worker that did not compute it",
    )
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    args = ap.parse_args(argv)

    import random

    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    rng = random.Random(0)
    firsts = [[rng.randrange(100, vocab) for _ in range(args.history)] for _ in range(args.conversations)]
    tails = [[rng.randrange(100, vocab) for _ in range(args.user)] for _ in range(args.conversations)]
    total_tokens = args.conversations * (args.history + OUT_TOKENS + args.user)
    max_len = args.history + OUT_TOKENS + args.user + OUT_TOKENS + args.block_size
    blocks = max(-(-max_len // args.block_size), int(total_tokens * args.pool_fraction) // args.block_size)
    print(
        f"{args.conversations} conversations, {total_tokens} tokens of KV; RAM pool {blocks} blocks "
        f"({blocks * args.block_size / total_tokens:.2f} of it), {args.mode}",
        flush=True,
    )
    folder = Path(tempfile.mkdtemp(prefix="pdserve-kv-tier-"))
    logs = folder / "logs"
    logs.mkdir()
    common = [
        *(sys.executable, "-m", "pdserve.cli", "serve", "--model", args.model, "--dtype", "float32"),
        *("--num-blocks", str(blocks), "--max-model-len", str(max_len), "--block-size", str(args.block_size)),
        *(MODE_FLAGS[args.mode]),
    ]
    tier = ["--kv-offload-dir", str(folder / "kv"), "--kv-offload-size", "64GiB"]
    results: dict[str, dict] = {}
    answers: dict[str, list[str]] = {}
    for label, extra, first_turns in (("recompute", [], True), ("disk", tier, True), ("restarted", tier, False)):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        spec = ServerSpec(label, [*common, *extra, "--port", str(port)], "/health")
        with running(spec, base, logs / f"{label}.log"), httpx.Client() as client:
            first_token_time(client, base, firsts[0][:32])  # warm-up (a short prompt, its own blocks)
            if first_turns:
                turn1 = []
                for p in firsts:
                    ttft, answer = first_token_time(client, base, p)
                    turn1.append((ttft, answer))
                answers[label] = [a for _, a in turn1]
            else:
                answers[label] = answers["disk"]
            if args.mode == "2P1D":  # one request more: round-robin deals each return to the other prefill worker
                first_token_time(client, base, firsts[0][:32])
            seconds = []
            for p, (a, tail) in zip(firsts, zip(answers[label], tails)):
                prompt = (
                    p
                    + client.post(f"{base}/tokenize", json={"prompt": a, "add_special_tokens": False}).json()["tokens"]
                )
                ttft, _ = first_token_time(client, base, prompt + tail)
                seconds.append(ttft)
                print(f"  {label}: returning turn of {len(prompt + tail)} tokens, TTFT {ttft * 1e3:.0f} ms", flush=True)
            time.sleep(1.5)  # heartbeats carry the last counters
            results[label] = {"ttft_median_s": statistics.median(seconds), "ttft_s": seconds, **tier_counters(base)}
    same = answers["recompute"] == answers["disk"]
    base_ttft = results["recompute"]["ttft_median_s"]
    print("\n| server | returning turns: median TTFT | / recomputing | disk hits (tokens) |")
    print("|---|---:|---:|---:|")
    for label, r in results.items():
        hits = r.get("pdserve_kv_disk_hits_total", 0)
        print(f"| {label} | {r['ttft_median_s'] * 1e3:.0f} ms | {r['ttft_median_s'] / base_ttft:.3f} | {hits:.0f} |")
    print(f"\nfirst turns' greedy answers equal with and without the tier: {same}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=2)
        )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
