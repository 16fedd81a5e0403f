"""Start a real `pdserve serve` (gateway + worker processes) on loopback for a test, and always
stop it: SIGTERM to the supervisor, which stops its children; SIGKILL of the group on timeout."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path


def all_workers_joined(base: str, extra: tuple[str, ...]) -> bool:
    """/health answers 200 and lists as many live workers per pool as `serve` was asked for
    (health turns 200 with one worker per pool; the others may still be loading)."""
    import json

    def count(flag: str) -> int:
        return int(extra[extra.index(flag) + 1]) if flag in extra else 1

    try:
        with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
            if r.status != 200:
                return False
            live = json.loads(r.read()).get("live_workers", {})
    except OSError:
        return False
    if "--colocated" in extra:
        return live.get("colocated", 0) >= 1
    return live.get("prefill", 0) >= count("--prefill-workers") and live.get("decode", 0) >= count("--decode-workers")


def placement_pinned(extra: tuple[str, ...]) -> tuple[str, ...]:
    """`--prefill-placement remote` unless the test names a placement: these tests exercise the
    prefill pool and the KV transfer, which `serve`'s default (auto) skips for short prompts on
    an idle decode worker. The default itself: tests/e2e/test_prefill_placement.py, tests/cli/."""
    return () if any(a.startswith("--prefill-placement") for a in extra) else ("--prefill-placement", "remote")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, term_timeout_s: float = 20) -> None:
    """Stop a process started with start_new_session=True and everything in its group: SIGTERM
    (a graceful stop) and up to `term_timeout_s` for it, then SIGCONT and SIGKILL to the group
    (a stopped process dies of nothing else)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=term_timeout_s)
    for sig in (signal.SIGCONT, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
    proc.wait(timeout=10)


@contextlib.contextmanager
def running_server(
    model: Path,
    *extra: str,
    timeout_s: float = 180.0,
    env: dict[str, str] | None = None,
    default_placement: bool = False,  # leave `serve`'s own default placement (auto) unpinned
) -> Iterator[str]:
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--num-blocks",
        "256",
        "--max-model-len",
        "512",
        *(() if default_placement else placement_pinned(extra)),
        *extra,
    ]
    proc = subprocess.Popen(argv, start_new_session=True, env=dict(os.environ, **(env or {})))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited early with {proc.returncode}")
            if all_workers_joined(base, extra):
                break
            if time.monotonic() > deadline:
                raise TimeoutError("pdserve serve did not become healthy")
            time.sleep(0.25)
        yield base
    finally:
        stop_group(proc)
