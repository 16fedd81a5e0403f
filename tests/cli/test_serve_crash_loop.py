"""A worker that cannot start (here: a KV pool too small for one sequence) makes `pdserve serve`
stop with its error after a few quick exits, instead of restarting it for ever."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.e2e.cluster import free_port

pytestmark = pytest.mark.slow


def test_serve_stops_when_a_worker_keeps_failing_at_start(tiny_llama):
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(tiny_llama), "--port", str(free_port())]
    argv += ["--num-blocks", "2", "--max-model-len", "512"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=240, start_new_session=True)
    assert r.returncode == 1
    assert "KV cache too small" in r.stderr  # the worker's own error, shown
    assert "3 times in a row" in r.stderr and "stopping" in r.stderr
