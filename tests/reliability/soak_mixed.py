"""A long soak of one server (1 prefill, 2 decode workers) on the real-shape model (30 layers,
hidden 576, vocab 49k) with mixed traffic: plain completions (streamed or not), streamed chat, structured output (a JSON
schema), tools (tool_choice "required", no parser flag), n > 1, and clients that hang up early;
one decode worker killed (SIGKILL) a third of the way in. Checks that every request ends (an
answer or an error, never a client timeout), how long each took against what its max_tokens
allows, and that every KV block is free at the end. Not a pytest test (minutes): the suite's
bounded version is tests/reliability/test_soak.py.

    python -m tests.reliability.soak_mixed --minutes 20 [--concurrency 8] [--seed 0]

Prints a line a minute and a summary; exits 1 when a request timed out, a stream ended without
[DONE], or blocks were left held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

from pdserve.modelgen.make_model import make_model
from tests.e2e.cluster import running_server
from tests.e2e.repro_structured_first import SCHEMA, TOOL
from tests.reliability.test_client_disconnect import wait_all_idle
from tests.reliability.test_worker_failure import busy_decode_pid

KINDS = ("plain", "plain-stream", "chat-stream", "structured", "tools", "n2", "abort")
SECONDS_A_TOKEN = 2.0  # the allowance: 60 s + this per max_tokens (a loaded 2-core machine)


def request(kind: str, rng: random.Random) -> tuple[str, dict, float | None]:
    """(path, body, hang-up-after seconds or None) for one request of `kind`."""
    max_tokens = rng.randint(4, 48)
    prompt = [rng.randrange(3, 14000) for _ in range(rng.randint(8, 200))]  # the tokenizer's 14,632 ids
    words = " ".join(rng.choice(["city", "weather", "river", "stone", "market", "north"]) for _ in range(12))
    chat = {"messages": [{"role": "user", "content": words}], "max_tokens": max_tokens}
    if kind == "plain":
        return "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens}, None
    if kind == "plain-stream":
        return "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "stream": True}, None
    if kind == "chat-stream":
        return "/v1/chat/completions", {**chat, "stream": True, "temperature": 0.8}, None
    if kind == "structured":
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
        return "/v1/chat/completions", {**chat, "max_tokens": 64, "response_format": fmt}, None
    if kind == "tools":
        return "/v1/chat/completions", {**chat, "max_tokens": 64, "tools": [TOOL], "tool_choice": "required"}, None
    if kind == "n2":
        return "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "n": 2, "temperature": 1.0}, None
    return "/v1/completions", {"prompt": prompt, "max_tokens": 48, "stream": True}, rng.uniform(0.05, 3.0)


ERRORS: list[str] = []  # the first bodies of 5xx answers other than 503 (not ready)


def _note_error(status: int, text: str) -> None:
    if status >= 500 and status != 503 and len(ERRORS) < 10:
        ERRORS.append(f"{status} {text[:300]}")


async def one(client: httpx.AsyncClient, kind: str, rng: random.Random) -> tuple[str, float, int]:
    """(outcome, seconds, max_tokens)."""
    path, body, hang_up = request(kind, rng)
    allowance = 60 + SECONDS_A_TOKEN * body["max_tokens"]
    t0 = time.monotonic()
    try:
        if body.get("stream"):
            async with client.stream("POST", path, json=body, timeout=allowance) as r:
                text = ""
                async for chunk in r.aiter_text():
                    text += chunk
                    if hang_up is not None and time.monotonic() - t0 > hang_up:
                        return "hung up", time.monotonic() - t0, body["max_tokens"]
                if r.status_code != 200:
                    outcome = f"http {r.status_code}"
                    _note_error(r.status_code, text)
                elif "[DONE]" not in text:
                    outcome = "stream without [DONE]"
                elif '"error"' in text:
                    outcome = "stream error event"
                else:
                    outcome = "ok"
        else:
            r = await client.post(path, json=body, timeout=allowance)
            outcome = "ok" if r.status_code == 200 else f"http {r.status_code}"
            _note_error(r.status_code, r.text)
            if r.status_code == 200 and kind == "structured":
                json.loads(r.json()["choices"][0]["message"]["content"] or "{}")  # (a cut-off one raises)
            if r.status_code == 200 and kind == "tools" and not r.json()["choices"][0]["message"].get("tool_calls"):
                outcome = "tools without a call"
    except httpx.TimeoutException:
        outcome = "client timeout"
    except json.JSONDecodeError:
        outcome = "cut off by max_tokens"
    return outcome, time.monotonic() - t0, body["max_tokens"]


async def soak(base: str, seconds: float, concurrency: int, seed: int) -> dict:
    rng = random.Random(seed)
    outcomes: Counter[str] = Counter()
    by_kind: Counter[str] = Counter()
    worst = [0.0, 0]  # seconds, its max_tokens
    killed: list[int] = []
    t_end, t0 = time.monotonic() + seconds, time.monotonic()
    next_report = t0 + 60

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal next_report
        while time.monotonic() < t_end:
            if not killed and time.monotonic() > t0 + seconds / 3:
                killed.append(-1)  # (claimed: one kill)
                pid = await asyncio.to_thread(busy_decode_pid, base)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed[0] = pid
                    print(f"{time.monotonic() - t0:6.0f}s  killed decode worker pid {pid}", flush=True)
            kind = rng.choice(KINDS)
            outcome, took, max_tokens = await one(client, kind, rng)
            if outcome == "http 503":  # not ready (a worker restarting): back off as a client would
                await asyncio.sleep(1.0)
            outcomes[f"{kind}: {outcome}"] += 1
            by_kind[outcome] += 1
            if took > worst[0]:
                worst[:] = [took, max_tokens]
            if time.monotonic() > next_report:
                next_report += 60
                print(f"{time.monotonic() - t0:6.0f}s  {sum(by_kind.values())} requests: {dict(by_kind)}", flush=True)

    async with httpx.AsyncClient(base_url=base) as client:
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
    return {
        "outcomes": dict(outcomes),
        "by_outcome": dict(by_kind),
        "worst_s": worst,
        "killed": killed,
        "errors": ERRORS,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.reliability.soak_mixed", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "real", preset="real", quiet=True)
        flags = ["--prefill-workers", "1", "--decode-workers", "2", "--num-blocks", "1024", "--max-model-len", "512"]
        with running_server(model, *flags, timeout_s=600) as base:
            print(
                f"soak: {args.minutes} min, {args.concurrency} clients, real-shape model, 1 prefill + 2 decode workers",
                flush=True,
            )
            result = asyncio.run(soak(base, args.minutes * 60, args.concurrency, args.seed))
            free, total, running = wait_all_idle(base, timeout_s=30)
            result["blocks"] = {"free": free, "total": total, "running": running}
            metrics = httpx.get(f"{base}/metrics", timeout=5).text
            result["reconciled"] = [
                line for line in metrics.splitlines() if line.startswith("pdserve_requests_reconciled")
            ]
    print(json.dumps(result, indent=1))
    bad = sum(n for k, n in result["by_outcome"].items() if k in ("client timeout", "stream without [DONE]"))
    leaked = free != total or any(running.values())
    print(f"requests {sum(result['by_outcome'].values())}, bad {bad}, blocks {'LEAKED' if leaked else 'all free'}")
    return 1 if bad or leaked else 0


if __name__ == "__main__":
    raise SystemExit(main())
