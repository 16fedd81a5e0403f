"""Ctrl-C on `pdserve serve`: SIGINT to its whole process group (as a terminal sends it) shuts
every process down cleanly: exit code 0, one closing line, no traceback, nobody left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.e2e.cluster import free_port
from tests.reliability.procs import processes

pytestmark = pytest.mark.slow


def members(pgid: int) -> list[str]:
    return [" ".join(p.argv)[:120] for p in processes() if p.pgid == pgid]


def group_empty_within(pgid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_sigint_to_the_process_group_exits_cleanly(tiny_llama):
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--model",
            str(tiny_llama),
            "--port",
            str(port),
            "--num-blocks",
            "64",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "serve did not come up"
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).status == 200:
                    break
            except OSError:
                time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0
        tail = err.decode().split("pdserve ready", 1)[-1]
        assert "Traceback" not in tail and "KeyboardInterrupt" not in tail, tail
        assert tail.rstrip().splitlines()[-1] == "pdserve: stopped on SIGINT; all 3 processes exited"
        assert group_empty_within(proc.pid, 5), f"left in the group: {members(proc.pid)}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
