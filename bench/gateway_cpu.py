"""The gateway's CPU per output token: `python -m pdserve.bench.gateway_cpu`.

A real `pdserve gateway` process over model-free stub workers (bench/stub_workers.py: the real
protocol, tokens at once), so the gateway is the only process working per token. A burst of
`--requests` requests of `--max-tokens` tokens each (n = 1, ignore_eos) goes out at once, streamed
and then non-streamed; the gateway's user + system CPU time (/proc/PID/stat, all its threads)
over the burst, divided by the output tokens the clients received, is the figure. Each burst runs
`--repeats` times after one warm-up; the median is printed. `--mode disaggregated` (a prefill and
a decode stub: P's first token, D's batches) or `colocated`. Run it on two checkouts with
PYTHONPATH to compare code versions under the same conditions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from pdserve.bench.server_cpu import _CLK_TCK, _stat_fields

# The gateway under cProfile: uvicorn re-raises SIGTERM once shut down, so the stats are written
# by a handler installed before it starts.
_PROFILED = """
import cProfile, runpy, signal, sys
prof = cProfile.Profile()
def stop(*_):
    prof.disable()
    prof.dump_stats({path!r})
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
prof.enable()
runpy.run_module("pdserve.cli", run_name="__main__", alter_sys=True)
"""


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (every thread of it)."""
    fields = _stat_fields(Path(f"/proc/{pid}/stat").read_text())
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _one(session: aiohttp.ClientSession, url: str, max_tokens: int, stream: bool) -> int:
    """One request; returns the completion tokens it got (from its usage)."""
    body: dict = {"prompt": "hello world", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:300]!r}")
        if not stream:
            return (await resp.json())["usage"]["completion_tokens"]
        usage = None
        async for raw in resp.content:
            if raw.startswith(b"data: {"):
                obj = json.loads(raw[6:])
                if "error" in obj:
                    raise RuntimeError(str(obj["error"]))
                usage = obj.get("usage") or usage
        assert usage is not None, "no usage chunk"
        return usage["completion_tokens"]


async def burst(port: int, pid: int, requests: int, max_tokens: int, stream: bool) -> tuple[float, int, float]:
    """(gateway CPU seconds, output tokens, wall seconds) of one burst."""
    url = f"http://127.0.0.1:{port}/v1/completions"
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as session:
        cpu0, t0 = process_cpu_s(pid), time.perf_counter()
        tokens = await asyncio.gather(*(_one(session, url, max_tokens, stream) for _ in range(requests)))
        return process_cpu_s(pid) - cpu0, sum(tokens), time.perf_counter() - t0


def _wait_ready(port: int, timeout_s: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError("the gateway did not become ready")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.bench.gateway_cpu", description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", metavar="FILE", help="run the gateway under cProfile, its stats written to FILE")
    args = ap.parse_args(argv)

    from pdserve.modelgen.make_model import make_model

    with tempfile.TemporaryDirectory(prefix="gwcpu-") as tmp:
        model = make_model(Path(tmp) / "m", preset="tiny", quiet=True)
        env = {**os.environ, "PDSERVE_CLUSTER_SECRET": secrets.token_hex(32), "PDSERVE_LOG_LEVEL": "WARNING"}
        port, gw_addr = _free_port(), f"ipc://{tmp}/gw.sock"
        cmd = [sys.executable, "-m", "pdserve.cli", "gateway", "--model", str(model), "--port", str(port)]
        if args.profile:
            cmd[1:3] = ["-c", _PROFILED.format(path=os.path.abspath(args.profile))]
        gateway = subprocess.Popen([*cmd, "--worker-bind", gw_addr], env=env)
        stubs = subprocess.Popen([sys.executable, "-m", "pdserve.bench.stub_workers", args.mode, gw_addr, tmp], env=env)
        try:
            _wait_ready(port)
            print(f"gateway pid {gateway.pid}, {args.mode}, {args.requests} requests x {args.max_tokens} tokens")
            for stream in (True, False):
                asyncio.run(burst(port, gateway.pid, args.requests, args.max_tokens, stream))  # warm-up
                per_token = []
                for _ in range(args.repeats):
                    cpu_s, tokens, wall_s = asyncio.run(
                        burst(port, gateway.pid, args.requests, args.max_tokens, stream)
                    )
                    assert tokens == args.requests * args.max_tokens, f"{tokens} tokens received"
                    per_token.append(cpu_s / tokens * 1e6)
                    print(
                        f"  {'streamed' if stream else 'non-streamed'}: {cpu_s:.3f} s CPU, {tokens} tokens, "
                        f"{wall_s:.2f} s wall, {per_token[-1]:.1f} us/token",
                        flush=True,
                    )
                label = "streamed" if stream else "non-streamed"
                print(f"{label}: gateway CPU {statistics.median(per_token):.1f} us per output token (median)")
        finally:
            for proc in (stubs, gateway):
                proc.terminate()
            for proc in (stubs, gateway):
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
