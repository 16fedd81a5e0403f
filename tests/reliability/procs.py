"""Process-level helpers for fault tests: a `pdserve serve` whose Popen the test holds (to signal
and inspect the supervisor itself), worker pids from /metrics, and small polling helpers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.e2e.cluster import all_workers_joined, free_port, placement_pinned, stop_group
from tests.reliability.ledger import node_gauges


@dataclass
class Served:
    proc: subprocess.Popen
    base: str


@contextlib.contextmanager
def served(model: Path, *extra: str, timeout_s: float = 180.0, env: dict[str, str] | None = None) -> Iterator[Served]:
    """Like tests.e2e.cluster.running_server, but yields the supervisor's Popen too. Always
    stops everything: SIGTERM to the supervisor, then SIGKILL to anything left in its group."""
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
        *placement_pinned(extra),
        *extra,
    ]
    proc = subprocess.Popen(argv, start_new_session=True, env=dict(os.environ, **(env or {})))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not all_workers_joined(base, extra):
            if proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited early with {proc.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError("pdserve serve did not become healthy")
            time.sleep(0.25)
        yield Served(proc, base)
    finally:
        stop_group(proc)


def health_status(base: str) -> int | None:
    """HTTP status of /health, or None when nothing answers."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def metrics_text(base: str) -> str:
    return urllib.request.urlopen(f"{base}/metrics", timeout=2).read().decode()


def live_workers(base: str, role: str) -> dict[str, int]:
    """{node id: pid} of the workers of `role` the gateway counts as live (node ids are
    role-host-pid-hex; /metrics lists live workers only)."""
    nodes = re.findall(rf'pdserve_kv_blocks_total\{{node="({role}-[^"]+)"\}}', metrics_text(base))
    return {n: int(n.split("-")[-2]) for n in nodes}


def busy_worker_pid(base: str, role: str, wait_s: float = 5.0) -> int | None:
    """PID of a `role` worker reporting a running or waiting request (heartbeats every 0.5 s)."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        text = metrics_text(base)
        for gauge in ("pdserve_num_requests_running", "pdserve_num_requests_waiting"):
            for node, value in re.findall(rf'{gauge}\{{node="({role}-[^"]+)"\}} ([0-9.]+)', text):
                if float(value) > 0:
                    return int(node.split("-")[-2])
        time.sleep(0.05)
    return None


def wait_until(pred: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> float | None:
    """Seconds until `pred()` held, or None if it did not within `timeout_s`."""
    t0 = time.monotonic()
    while True:
        if pred():
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            return None
        time.sleep(step_s)


def resume(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGCONT)


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    argv: list[str]


def processes() -> list[Proc]:
    """Every process /proc shows (those gone while read are skipped)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            argv = open(f"/proc/{entry}/cmdline").read().split("\0")
        except (OSError, IndexError):
            continue
        out.append(Proc(int(entry), int(fields[1]), int(fields[2]), argv))
    return out


def rss_mib(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def worker_pids(base: str) -> dict[str, int]:
    """{node id: pid} of every live worker (node ids are role-host-pid-hex)."""
    return {node: int(node.split("-")[-2]) for node in node_gauges(base, "pdserve_kv_blocks_total")}
