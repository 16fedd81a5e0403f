"""A tensor-parallel engine's ranks fail cleanly: a dead or stuck rank makes rank 0 raise (no
hang in a collective), and no rank process outlives its engine or rank 0's process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve.engine.parallel.group import TensorParallelError
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import random_prompts
from tests.engine.tensor_parallel_models import tp_engine

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
PROMPTS = random_prompts(512, [9, 21], seed=1)


def gone(pid: int) -> bool:
    """No such process, or a zombie (exited, not yet reaped by whoever inherited it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(map(gone, pids)):
            return True
        time.sleep(0.1)
    return False


def test_rank_killed_between_steps_raises_at_the_next_step(tiny_llama):
    engine = tp_engine(tiny_llama, 2)
    try:
        engine.generate(PROMPTS, GREEDY)
        (pid,) = engine.runner.ranks.pids  # type: ignore[attr-defined]
        os.kill(pid, signal.SIGKILL)
        assert wait_gone([pid], 5)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pid}\) exited with -9"):
            engine.generate(PROMPTS, GREEDY)
        assert time.monotonic() - t0 < 5
    finally:
        engine.close()


def test_rank_killed_inside_a_step_fails_the_collective(tiny_llama):
    """Killed after it was rung for a step, before the step's broadcasts: rank 0's collective fails."""
    engine = tp_engine(tiny_llama, 2)
    try:
        ranks = engine.runner.ranks  # type: ignore[attr-defined]
        (proc,) = ranks.procs
        ring = ranks.ring

        def ring_then_kill() -> None:
            ring()
            proc.kill()
            proc.wait()

        ranks.ring = ring_then_kill
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="collective failed.*exited with -9"):
            engine.generate(PROMPTS, GREEDY)
        assert time.monotonic() - t0 < 10
    finally:
        engine.close()


def test_stuck_rank_times_out_instead_of_hanging(tiny_llama):
    engine = tp_engine(tiny_llama, 2, tensor_parallel_timeout_s=3.0)
    (pid,) = engine.runner.ranks.pids  # type: ignore[attr-defined]
    try:
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1"):
            engine.generate(PROMPTS, GREEDY)
        assert time.monotonic() - t0 < 3.0 + 5.0
    finally:
        engine.close()  # kills the stopped rank after its grace period
    assert gone(pid)


def test_closed_engine_leaves_no_rank_processes(tiny_llama):
    engine = tp_engine(tiny_llama, 2)
    pids = engine.runner.ranks.pids  # type: ignore[attr-defined]
    engine.generate(PROMPTS, GREEDY)
    engine.close()
    assert wait_gone(pids, 5)
    engine.close()  # idempotent


def test_ranks_exit_when_rank_0_is_killed(tiny_llama):
    script = (
        "import sys, time\n"
        "from tests.engine.tensor_parallel_models import tp_engine\n"
        f"e = tp_engine({str(tiny_llama)!r}, 2)\n"
        "print(*e.runner.ranks.pids, flush=True)\n"
        "time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        assert proc.stdout is not None
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and not any(map(gone, pids))
        proc.kill()
        proc.wait()
        assert wait_gone(pids, 10), "a rank outlived rank 0"
    finally:
        proc.kill()
        proc.wait()
