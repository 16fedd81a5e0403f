"""`pdserve bench`: load generator for any OpenAI-compatible server, with the flags and result
keys of vLLM's `vllm bench serve` so results compare one to one."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from datetime import datetime
from pathlib import Path

import aiohttp
import httpx
from tqdm import tqdm

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import build_payload, send
from pdserve.bench.conversations import make_conversations, per_turn, run_conversations
from pdserve.bench.datasets import BenchRequest, jsonl_requests, random_requests, sharegpt_requests
from pdserve.bench.kv_usage import KvUsagePoller
from pdserve.bench.metrics import METRICS, compute_metrics
from pdserve.bench.plots import plot_sweep
from pdserve.bench.sweep import capacity


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pdserve bench", description=__doc__)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name sent to the server (default: its first /v1/models)")
    ap.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer folder (default: --model if a folder, else the server's /v1/models root)",
    )
    ap.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    ap.add_argument("--dataset-name", default="random", choices=["random", "sharegpt", "jsonl", "conversations"])
    ap.add_argument("--dataset-path", default=None)
    ap.add_argument("--random-input-len", type=int, default=1024)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--random-prefix-len", type=int, default=0)
    ap.add_argument("--tokenized-prompts", action="store_true", help="send token-id prompts (completions only)")
    g = ap.add_argument_group("conversations (--dataset-name conversations; --num-prompts conversations)")
    g.add_argument("--conv-system-len", type=int, default=1000, help="tokens of the system prompt all share")
    g.add_argument("--conv-turns", default="5-10", help="user turns per conversation, MIN-MAX")
    g.add_argument("--conv-user-len", type=int, default=64, help="tokens of each new user message")
    g.add_argument(
        "--conv-think-time", type=float, default=2.0, help="mean seconds between an answer and the next turn"
    )
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson; inf = burst")
    ap.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of gaps (1 = Poisson)")
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--n", type=int, default=1, help="choices per request (OpenAI n; output tok/s counts all)")
    ap.add_argument("--goodput", nargs="+", default=None, help="SLOs like ttft:2000 tpot:60 e2el:10000 (ms)")
    ap.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
    ap.add_argument("--metric-percentiles", default="50,90,99")
    ap.add_argument("--warmup-requests", type=int, default=0, help="untimed burst first")
    ap.add_argument("--save-result", action="store_true")
    ap.add_argument("--result-dir", default=".")
    ap.add_argument("--result-filename", default=None)
    ap.add_argument("--label", default=None, help="server label in results and plots")
    ap.add_argument("--sweep-rates", default=None, help="e.g. 0.5,1,2,4: one run per rate, then plots")
    ap.add_argument("--compare", nargs="*", default=[], help="result JSON files of other servers to plot beside")
    ap.add_argument("--disable-tqdm", action="store_true")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    return ap


def parse_slos(items: list[str] | None) -> dict[str, float]:
    slos = {}
    for item in items or []:
        key, _, value = item.partition(":")
        if key not in ("ttft", "tpot", "e2el") or not value:
            raise SystemExit(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        slos[key] = float(value)
    return slos


def load_requests(args, tokenizer, seed: int) -> list[BenchRequest]:
    if args.dataset_name == "random":
        return random_requests(
            tokenizer,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            seed,
            args.tokenized_prompts,
        )
    if not args.dataset_path:
        raise SystemExit(f"--dataset-name {args.dataset_name} needs --dataset-path")
    if args.dataset_name == "sharegpt":
        return sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts, seed)
    return jsonl_requests(tokenizer, args.dataset_path, args.num_prompts)


async def run_once(
    args, model: str, tokenizer, requests: list[BenchRequest], rate: float, slos: dict[str, float], seed: int
) -> dict:
    url = args.base_url.rstrip("/") + args.endpoint
    connector = aiohttp.TCPConnector(limit=0)  # no cap on connections: --max-concurrency caps
    # per operation, as before with httpx: no chunk for --request-timeout s fails the request
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=args.request_timeout, sock_read=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        if args.warmup_requests:
            warm = requests[: args.warmup_requests]
            await asyncio.gather(
                *[
                    send(
                        client,
                        url,
                        build_payload(
                            r, model, args.endpoint, temperature=args.temperature, ignore_eos=args.ignore_eos, n=args.n
                        ),
                        r,
                        tokenizer,
                    )
                    for r in warm
                ]
            )
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(requests), disable=args.disable_tqdm, desc=f"rate {rate:g}", unit="req")
        offsets = arrival_offsets(len(requests), rate, args.burstiness, seed)
        start = time.perf_counter()

        async def one(req: BenchRequest, at: float):
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            payload = build_payload(
                req, model, args.endpoint, temperature=args.temperature, ignore_eos=args.ignore_eos, n=args.n
            )
            if sem is None:
                result = await send(client, url, payload, req, tokenizer)
            else:
                async with sem:
                    result = await send(client, url, payload, req, tokenizer)
            bar.update(1)
            return result

        async with KvUsagePoller(args.base_url) as kv:
            results = await asyncio.gather(*[one(r, at) for r, at in zip(requests, offsets)])
        duration = time.perf_counter() - start
        bar.close()
    selected = tuple(m for m in args.percentile_metrics.split(",") if m in METRICS)
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    metrics = compute_metrics(
        results, duration, percentiles=percentiles, selected=selected, goodput_slos_ms=slos or None
    )
    errors = [r.error for r in results if not r.success]
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "label": args.label or model,
        "model_id": model,
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "num_prompts": len(requests),
        "request_rate": rate if not math.isinf(rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "goodput_slos_ms": slos,
        "n": args.n,
        **metrics,
        # peak share of the KV cache in use (pdserve: its decode/colocated workers; vLLM's gauge)
        "peak_kv_usage": kv.peak_fraction,
        "peak_kv_blocks": kv.peak_blocks,
        "errors": errors[:5],
    }


def run_conversation_bench(args, model: str, tokenizer, slos: dict[str, float]) -> dict:
    lo, _, hi = args.conv_turns.partition("-")
    convs = make_conversations(
        tokenizer,
        args.num_prompts,
        args.conv_system_len,
        (int(lo), int(hi or lo)),
        args.conv_user_len,
        args.random_output_len,
        args.seed,
    )
    results, duration = asyncio.run(
        run_conversations(
            args.base_url,
            model,
            tokenizer,
            convs,
            rate=args.request_rate,
            think_time_s=args.conv_think_time,
            ignore_eos=args.ignore_eos,
            seed=args.seed,
            timeout_s=args.request_timeout,
        )
    )
    percentiles = tuple(float(p) for p in args.metric_percentiles.split(","))
    metrics = compute_metrics([r for _, r in results], duration, percentiles=percentiles, goodput_slos_ms=slos or None)
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": args.label or model,
        "model_id": model,
        "base_url": args.base_url,
        "dataset": "conversations",
        "conversations": len(convs),
        "request_rate": args.request_rate if not math.isinf(args.request_rate) else "inf",
        "goodput_slos_ms": slos,
        **metrics,
        "turns": per_turn(results),
        "errors": [r.error for _, r in results if not r.success][:5],
    }


def print_summary(res: dict, slos: dict) -> None:
    line = "=" * 50
    print(f"{' Serving Benchmark Result ':=^50}")
    for key, label in (
        ("completed", "Successful requests"),
        ("failed", "Failed requests"),
        ("duration", "Benchmark duration (s)"),
        ("total_input_tokens", "Total input tokens"),
        ("total_output_tokens", "Total generated tokens"),
        ("request_throughput", "Request throughput (req/s)"),
        ("request_goodput", "Request goodput (req/s)"),
        ("output_throughput", "Output token throughput (tok/s)"),
        ("total_token_throughput", "Total token throughput (tok/s)"),
    ):
        if key in res:
            v = res[key]
            print(f"{label:<40}{v:<10.2f}" if isinstance(v, float) else f"{label:<40}{v:<10}")
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        if f"mean_{name}_ms" not in res:
            continue
        print(f"{title:-^50}")
        for k in sorted(k for k in res if k.endswith(f"_{name}_ms")):
            print(f"{k.removesuffix(f'_{name}_ms').capitalize() + ' ' + name.upper() + ' (ms):':<40}{res[k]:<10.2f}")
    if "turns" in res:
        print(f"{'Per turn':-^50}")
        print(f"{'turn':>4} {'n':>4} {'p50 TTFT ms':>12} {'p90 TTFT ms':>12} {'cached tok':>11} {'KV bytes':>10}")
        for turn, t in res["turns"].items():
            print(
                f"{turn:>4} {t['completed']:>4} {t['median_ttft_ms']:>12.1f} {t['p90_ttft_ms']:>12.1f} "
                f"{t['mean_cached_tokens']:>11.0f} {t['mean_kv_bytes']:>10.0f}"
            )
    if "ttft_breakdown_mean" in res:
        print(f"{'TTFT breakdown (server, mean)':-^50}")
        for k, v in res["ttft_breakdown_mean"].items():
            print(f"{k:<40}{v:<10.4f}")
    print(line)


def bench_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    slos = parse_slos(args.goodput)
    base = args.base_url.rstrip("/")
    model = args.model
    listed: dict = {}
    if model is None or not Path(model).exists() or args.tokenizer is None:
        listed = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]
        model = model or listed["id"]
    # the tokenizer: --tokenizer, else --model if a folder, else the server's model folder (root)
    tok_path = args.tokenizer or (args.model if args.model and Path(args.model).is_dir() else None)
    if tok_path is None and listed.get("root") and Path(listed["root"]).is_dir():
        tok_path = listed["root"]
    if tok_path is None:
        raise SystemExit(
            "--tokenizer (an HF tokenizer folder) is needed to build prompts: the server "
            "names no model folder readable here"
        )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_path)
    if Path(model).is_dir():  # the server names the model by its own id
        model = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    out_dir = Path(args.result_dir)
    if args.sweep_rates and args.dataset_name == "conversations":
        raise SystemExit("--sweep-rates runs single requests; conversations run one rate at a time")
    if args.sweep_rates:
        rows = []
        for f in args.compare:  # other servers' sweep files (or single results)
            data = json.loads(Path(f).read_text())
            rows += (
                [dict(r, label=data.get("label", r.get("label"))) for r in data["runs"]] if "runs" in data else [data]
            )
        mine = []
        for i, rate in enumerate(float(r) for r in args.sweep_rates.split(",")):
            requests = load_requests(args, tokenizer, args.seed + 1000 * (i + 1))  # fresh prompts per rate
            res = asyncio.run(run_once(args, model, tokenizer, requests, rate, slos, args.seed + i))
            print_summary(res, slos)
            mine.append(res)
        label = args.label or model
        points = [(r["request_rate"], r.get("goodput_attainment", 0.0)) for r in mine]
        cap = capacity(points) if slos else None
        summary = {"label": label, "capacity_req_s": cap, "slos_ms": slos, "runs": mine}
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / (args.result_filename or f"sweep-{label.replace('/', '_')}.json")
        path.write_text(json.dumps(summary, indent=2))
        slo_text = "(" + ", ".join(f"{k} <= {v:g} ms" for k, v in slos.items()) + ")" if slos else ""
        pngs = plot_sweep(rows + mine, out_dir, slo_text)
        print(f"capacity ({label}): {cap} req/s; results {path}; plots {', '.join(str(p) for p in pngs)}")
        return 0
    if args.dataset_name == "conversations":
        res = run_conversation_bench(args, model, tokenizer, slos)
    else:
        requests = load_requests(args, tokenizer, args.seed)
        res = asyncio.run(run_once(args, model, tokenizer, requests, args.request_rate, slos, args.seed))
    print_summary(res, slos)
    if args.save_result:
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / (args.result_filename or f"bench-{res['label'].replace('/', '_')}-{res['date']}.json")
        path.write_text(json.dumps(res, indent=2))
        print(f"saved {path}")
    return 0 if res["completed"] else 1
