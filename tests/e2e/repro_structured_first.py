"""Fresh-start check that the first structured request on a new 1P1D server finishes: start a
new `pdserve serve` (1 prefill + 1 decode worker, `serve`'s default placement, auto), send a
chat request with a `json_schema` response_format (or, alternating, a named tool_choice) first,
greedy, and count a hang when no answer comes within `--timeout` seconds; repeat with a new server
each time, optionally beside a CPU hog (a busy loop in another process, as on a loaded machine).

Before the reservation fix, the decode worker took the prompt to prefill it itself (auto
placement) and built its structured-output tokenizer at that first constraint, seconds on a
loaded machine; the gateway gave up on the reservation after `reserve_timeout_s` (5 s), aborted
it, and asked again, then took the late "local" answer to the first ask as the answer to the
second and waited for tokens that the abort had cut off (docs/reliability.md, "The first
structured request"). Not a pytest test (minutes of server starts); the fix's regression tests
are tests/gateway/test_reservation_replies.py and tests/reliability/test_reconcile.py.

    python -m tests.e2e.repro_structured_first --starts 20 [--hog] [--preset real] [-- serve flags]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from pdserve.modelgen.make_model import make_model
from tests.e2e.cluster import running_server

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer"}},
    "required": ["city", "population"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def body(kind: str) -> dict:
    b: dict = {
        "messages": [{"role": "user", "content": "A city and its population, please."}],
        "max_tokens": 120,
        "temperature": 0,
    }
    if kind == "tool":
        b |= {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    else:
        b["response_format"] = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    return b


@contextlib.contextmanager
def cpu_hog(on: bool) -> Iterator[None]:
    proc = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if on else None
    try:
        yield
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def one_start(model: Path, kind: str, extra: list[str], timeout_s: float, hog: bool) -> str:
    """'ok', 'hang' or 'error: ...' for the first request on a fresh server."""
    with cpu_hog(hog), running_server(model, *extra, timeout_s=300, default_placement=True) as base:
        started = time.monotonic()
        try:
            r = httpx.post(f"{base}/v1/chat/completions", json=body(kind), timeout=timeout_s)
        except httpx.TimeoutException:
            print(f"  hang; {_telling_metrics(base)}", flush=True)
            return "hang"
        took = time.monotonic() - started
        if r.status_code != 200:
            return f"error: {r.status_code} {r.text[:200]}"
        choice = r.json()["choices"][0]
        print(f"  {kind}: {took:.1f} s, finish {choice['finish_reason']}; {_telling_metrics(base)}", flush=True)
        return "ok"


def _telling_metrics(base: str) -> str:
    """The /metrics lines that tell where a request went (local prefill, queue wait, in flight)."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    keep = (
        "pdserve_local_prefills",
        "pdserve_gateway_requests_in_flight",
        "pdserve_requests_reconciled",
        'pdserve_queue_wait_seconds_sum{pool="disaggregated"}',
    )
    return "; ".join(ln for ln in text.splitlines() if ln.startswith(keep))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--starts", type=int, default=20)
    ap.add_argument("--hog", action="store_true", help="a CPU busy loop beside the server")
    ap.add_argument("--preset", default="real", help="make-model preset (real: 30 layers, hidden 576, vocab 49152)")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds without an answer that count as a hang")
    ap.add_argument("--model", type=Path, help="an existing model folder instead of a random one")
    ap.add_argument("extra", nargs="*", help="more `pdserve serve` flags (after --)")
    args = ap.parse_args()
    model = args.model or make_model(Path(tempfile.mkdtemp()) / f"{args.preset}-llama", preset=args.preset, seed=3)
    counts: dict[str, int] = {}
    for k in range(args.starts):
        kind = "json_schema" if k % 2 == 0 else "tool"
        extra = [*args.extra, *(["--tool-call-parser", "hermes"] if "--tool-call-parser" not in args.extra else [])]
        outcome = one_start(model, kind, extra, args.timeout, args.hog)
        counts[outcome] = counts.get(outcome, 0) + 1
        print(f"start {k} ({kind}{', hog' if args.hog else ''}): {outcome}", flush=True)
    print(json.dumps(counts), f"in {args.starts} fresh starts", flush=True)
    hangs = counts.get("hang", 0)
    print(f"{hangs} of {args.starts} fresh starts hung", flush=True)


if __name__ == "__main__":
    main()
