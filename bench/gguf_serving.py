"""One GGUF file served by pdserve (colocated and 1P1D) and by llama.cpp's llama-server, on the same
machine in one run: start-up, resident memory, one-at-a-time TPOT and a burst's output tok/s.

    python -m pdserve.bench.gguf_serving --model FILE.gguf --llama-server .../llama-server \
        [--servers pdserve-colocated,pdserve-1P1D,llama.cpp] [--rounds 2] [--out DIR]

Each server is started alone, timed from launch to its first 200 (ready), warmed up with an untimed
burst, measured, and stopped; `--rounds` rounds, the order reversed every other round, the median
round reported. Workloads (prompts are random token ids, greedy, ignore_eos):
    single : `--single` requests one after another, `--single-prompt` (64) token prompts, 64
             tokens out: TPOT = (latency - first token) / (tokens - 1), median over requests
    burst  : `--burst` requests at once, prompts 64-256 tokens, 32-64 out: output tok/s
Memory: each server's process tree after its measurement, RSS and PSS (/proc/PID/smaps_rollup:
a page mapped by k processes counts 1/k in each one's PSS, so the PSS sum is the host's share;
the workers of a 1P1D pair map the same file).
Every streamed chunk counts as a token, text or not (llama-server streams a token whose piece is
empty, such as the unused-type tokens a converter pads a vocabulary with, as an empty chunk).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from pdserve.bench.servers import ServerSpec, free_port, llamacpp_spec, running

SERVERS = ("pdserve-colocated", "pdserve-1P1D", "llama.cpp")


@dataclass
class Stream:
    ok: bool
    tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    error: str = ""


async def _stream(session: aiohttp.ClientSession, url: str, prompt: list[int], out: int) -> Stream:
    body = {
        "prompt": prompt,
        "max_tokens": out,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "min_tokens": out,
        "stream_options": {"include_usage": True},
    }
    start, ttft, chunks, usage = time.perf_counter(), None, 0, None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return Stream(False, error=f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
            async for raw in resp.content:
                if not raw.startswith(b"data:") or raw[5:].strip() == b"[DONE]":
                    continue
                obj = json.loads(raw[5:])
                usage = obj.get("usage") or usage
                if obj.get("choices"):
                    chunks += 1
                    ttft = ttft if ttft is not None else time.perf_counter() - start
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        return Stream(False, error=f"{type(e).__name__}: {e}")
    tokens = int((usage or {}).get("completion_tokens") or chunks)
    return Stream(ttft is not None, tokens, ttft or 0.0, time.perf_counter() - start)


def _session() -> aiohttp.ClientSession:
    """A fresh connection a request: a kept-alive one the server has since closed would fail the
    request ("Can not write request body", seen with llama-server)."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=3600), connector=aiohttp.TCPConnector(force_close=True)
    )


async def _burst(url: str, requests: list[tuple[list[int], int]]) -> tuple[float, list[Stream]]:
    async with _session() as s:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_stream(s, url, p, n) for p, n in requests))
        return time.perf_counter() - t0, list(results)


async def _single(url: str, requests: list[tuple[list[int], int]]) -> list[Stream]:
    async with _session() as s:
        return [await _stream(s, url, p, n) for p, n in requests]


def _requests(rng: random.Random, vocab: int, n: int, prompt: tuple[int, int], out: tuple[int, int]):
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt))], rng.randint(*out)) for _ in range(n)]


def _tree(pid: int) -> list[int]:
    """pid and its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _memory(pid: int) -> dict[str, float]:
    """GB of RSS and PSS summed over the process tree, and the largest process's RSS."""
    rss = pss = biggest = 0.0
    for p in _tree(pid):
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines()[1:])
        except OSError:
            continue
        r, s = (int(fields[k].split()[0]) / 1e6 for k in ("Rss", "Pss"))  # kB -> GB
        rss, pss, biggest = rss + r, pss + s, max(biggest, r)
    return {"rss_gb": round(rss, 2), "pss_gb": round(pss, 2), "largest_rss_gb": round(biggest, 2)}


def _specs(
    model: str, llama_server: str | None, port: int, slots: int, threads: int, kv_memory: str, slot_ctx: int = 512
) -> dict[str, ServerSpec]:
    """`slot_ctx`: the context each of llama-server's slots holds (its -c is slots x this)."""
    py = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model",
        model,
        "--port",
        str(port),
        "--kv-cache-memory",
        kv_memory,
        "--max-model-len",
        "4096",
    ]
    llama = _http_threads(llamacpp_spec(port, llama_server, model, slots, slots * slot_ctx, threads), slots)
    return {
        "pdserve-colocated": ServerSpec("pdserve-colocated", py + ["--colocated"], "/health"),
        "pdserve-1P1D": ServerSpec("pdserve-1P1D", py, "/health"),
        "llama.cpp": llama,
        # KV in 8 bits: pdserve's int8 rows against llama.cpp's q8_0 cache (both ~0.27x fp32's bytes)
        "pdserve-colocated-int8kv": ServerSpec(
            "pdserve-colocated-int8kv", py + ["--colocated", "--kv-cache-dtype", "int8"], "/health"
        ),
        "pdserve-colocated-fp8kv": ServerSpec(
            "pdserve-colocated-fp8kv", py + ["--colocated", "--kv-cache-dtype", "fp8"], "/health"
        ),
        "llama.cpp-q8_0kv": ServerSpec(
            "llama.cpp-q8_0kv", [*llama.argv, "-ctk", "q8_0", "-ctv", "q8_0"], skip_reason=llama.skip_reason
        ),
    }


def _with_env(specs: dict[str, ServerSpec], name: str) -> ServerSpec:
    """The server `name` names: a spec's label, or one followed by `+VAR=VALUE`s, the same server
    started with those variables set (e.g. `pdserve-colocated+GOMP_SPINCOUNT=2000`)."""
    base, *settings = name.split("+")
    spec = specs[base]
    env = dict(setting.split("=", 1) for setting in settings)
    return dataclasses.replace(spec, label=name, env={**spec.env, **env}) if env else spec


def _http_threads(spec: ServerSpec, slots: int) -> ServerSpec:
    """llama-server's HTTP threads default to slots + 2: connections of an earlier phase still kept
    alive then leave a burst's last requests unwritten ("Can not write request body")."""
    if not spec.skip_reason:
        spec.argv += ["--threads-http", str(2 * slots + 8)]
    return spec


def measure(spec: ServerSpec, port: int, vocab: int, args, round_no: int, log_dir: Path) -> dict:
    base = f"http://127.0.0.1:{port}"
    url = base + "/v1/completions"
    rng = random.Random(1000 * round_no + 7)
    warm = _requests(rng, vocab, 4, (64, 128), (8, 16))
    single = _requests(rng, vocab, args.single, (args.single_prompt, args.single_prompt), (64, 64))
    burst = _requests(rng, vocab, args.burst, (64, 256), (32, 64))
    t0 = time.perf_counter()
    with running(spec, base, log_dir / f"{spec.label}-{round_no}.log", timeout_s=900) as proc:
        ready = time.perf_counter() - t0
        asyncio.run(_burst(url, warm))
        singles = asyncio.run(_single(url, single))
        wall, streams = asyncio.run(_burst(url, burst))
        memory = _memory(proc.pid)
    failed = [s.error for s in singles + streams if not s.ok]
    tpots = [(s.latency - s.ttft) / (s.tokens - 1) for s in singles if s.ok and s.tokens > 1]
    return {
        "server": spec.label,
        "round": round_no,
        "ready_s": round(ready, 1),
        "tpot_ms": round(1000 * statistics.median(tpots), 1) if tpots else None,
        "single_ttft_ms": round(1000 * statistics.median(s.ttft for s in singles if s.ok), 1) if tpots else None,
        "burst_output_tok_s": round(sum(s.tokens for s in streams if s.ok) / wall, 2),
        "burst_wall_s": round(wall, 1),
        "failed": failed,
        **memory,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a GGUF file")
    ap.add_argument("--llama-server", default=os.environ.get("PDSERVE_LLAMA_SERVER"))
    ap.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help="also: pdserve-colocated-int8kv / -fp8kv (--kv-cache-dtype int8 / fp8), llama.cpp-q8_0kv (-ctk q8_0 -ctv q8_0); "
        "NAME+VAR=VALUE: that server with the variable set",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--single", type=int, default=4, help="requests one at a time")
    ap.add_argument("--single-prompt", type=int, default=64, help="their prompt tokens (4000: TPOT at a 4k context)")
    ap.add_argument("--burst", type=int, default=16, help="requests at once")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server's -t")
    ap.add_argument("--kv-cache-memory", default="512MiB", help="pdserve's KV budget a worker (4096 tokens must fit)")
    ap.add_argument("--out", default=None, help="folder for the JSON record and server logs")
    args = ap.parse_args()

    from pdserve.engine.config import ModelConfig

    vocab = ModelConfig.from_folder(args.model).vocab_size
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="gguf-serving-"))
    out.mkdir(parents=True, exist_ok=True)
    names = [s for s in args.servers.split(",") if s]
    rows = []
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            port = free_port()
            spec = _with_env(
                _specs(
                    args.model,
                    args.llama_server,
                    port,
                    args.burst,
                    args.threads,
                    args.kv_cache_memory,
                    max(512, args.single_prompt + 128),
                ),
                name,
            )
            if spec.skip_reason:
                print(f"{name}: skipped ({spec.skip_reason})")
                continue
            row = measure(spec, port, vocab, args, r, out)
            print(json.dumps(row), flush=True)
            rows.append(row)
    record = {"model": args.model, "date": time.strftime("%Y-%m-%d"), "args": vars(args), "rows": rows}
    (out / "gguf_serving.json").write_text(json.dumps(record, indent=1))
    print(f"\n{args.model}, {args.rounds} round(s), median round:")
    print("| server | ready s | RSS GB (PSS) | TPOT ms, one at a time | burst output tok/s | failed requests |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in names:
        mine = [x for x in rows if x["server"] == name]
        if not mine:
            continue
        med = lambda k: statistics.median(x[k] for x in mine if x[k] is not None)  # noqa: E731
        print(
            f"| {name} | {med('ready_s'):.1f} | {med('rss_gb'):.2f} ({med('pss_gb'):.2f}) | "
            f"{med('tpot_ms'):.1f} | {med('burst_output_tok_s'):.2f} | {sum(len(x['failed']) for x in mine)} |"
        )
    print(f"record: {out / 'gguf_serving.json'}")


if __name__ == "__main__":
    main()
