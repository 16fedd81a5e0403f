"""Start pdserve's roles as separate processes on loopback, as an operator (or a Kubernetes pod)
would: `pdserve gateway`, `pdserve prefill|decode --gateway ...`. Every process gets its own
session and log file; all are killed when the block ends, whatever happened."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e.cluster import placement_pinned


@dataclass
class Procs:
    log_dir: Path
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**self.env, **(env or {})}
        )
        log.close()
        self.procs[name] = proc
        return proc

    def pdserve(self, name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        if args and args[0] in ("gateway", "serve"):  # these tests exercise the pool and the KV transfer
            args = (*args, *placement_pinned(args[1:]))
        return self.start(name, [sys.executable, "-m", "pdserve.cli", *args], env)

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def stop_all(self) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)


@contextlib.contextmanager
def processes(log_dir: Path) -> Iterator[Procs]:
    """Processes sharing a fresh cluster secret; all killed on exit (their logs stay)."""
    env = dict(os.environ, PDSERVE_CLUSTER_SECRET=secrets.token_hex(32), PYTHONSAFEPATH="1")
    procs = Procs(log_dir, env)
    try:
        yield procs
    finally:
        procs.stop_all()


def get_json(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None):
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def workers(base: str) -> list[dict]:
    return get_json(f"{base}/v1/workers")["data"]


def wait_for(cond, timeout_s: float, what: str, procs: Procs | None = None, poll_s: float = 0.2):
    """Poll `cond()` (exceptions count as not yet) until truthy; fail naming `what`, and any
    watched process that exited meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            got = cond()
            if got:
                return got
        time.sleep(poll_s)
    exited = {n: p.returncode for n, p in (procs.procs.items() if procs else []) if p.poll() is not None}
    raise AssertionError(f"timed out waiting for {what} (exited: {exited})")


def stream_text(base: str, prompt: list[int], max_tokens: int, model: str = "tiny-llama") -> str:
    """A greedy streamed completion's text; fails on a non-200 answer or an error event."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    text = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                text.append(chunk["choices"][0]["text"])
    return "".join(text)
