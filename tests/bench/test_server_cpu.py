"""The server CPU meter: /proc parsing on a made-up tree, and a real session that burns CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve.bench.server_cpu import CpuMeter, cpu_figures, session_cpu_by_role

TCK = os.sysconf("SC_CLK_TCK")


def _fake_proc(root, pid, comm, sid, utime, stime, argv=("python",)):
    # proc(5): pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
    d = root / str(pid)
    d.mkdir()
    (d / "stat").write_text(f"{pid} ({comm}) S 1 {sid} {sid} 0 -1 0 0 0 0 0 {utime} {stime} 0 0 20 0 1 0\n")
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")


def test_session_sum_counts_only_that_session_by_role(tmp_path):
    pd = ("python", "-m", "pdserve.cli")
    _fake_proc(tmp_path, 100, "python", 100, 3 * TCK, 1 * TCK, pd + ("serve", "--model", "m"))
    _fake_proc(tmp_path, 101, "odd) name (x", 100, 2 * TCK, 0, pd + ("prefill", "--bind", "x"))  # ") " in the name
    _fake_proc(tmp_path, 102, "python", 100, 1 * TCK, 0, pd + ("prefill",))
    _fake_proc(tmp_path, 103, "llama-server", 100, 5 * TCK, 0, ("llama-server", "-m", "prefill"))
    _fake_proc(tmp_path, 200, "other", 200, 50 * TCK, 50 * TCK, pd + ("decode",))
    (tmp_path / "self").mkdir()  # not a pid: skipped
    assert session_cpu_by_role(100, tmp_path) == pytest.approx({"serve": 4.0, "prefill": 3.0, "server": 5.0})
    assert sum(session_cpu_by_role(100, tmp_path).values()) == pytest.approx(12.0)
    assert sum(session_cpu_by_role(300, tmp_path).values()) == 0.0


def test_meter_sees_a_forked_child_burn_cpu(tmp_path):
    done = tmp_path / "burned"
    burn = (
        "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
        f"open({str(done)!r}, 'w').close()\ntime.sleep(60)"
    )
    # the session leader forks a child that burns CPU: the child's time must be counted too
    leader = subprocess.Popen(
        [sys.executable, "-c", f"import subprocess, sys; subprocess.run([sys.executable, '-c', {burn!r}])"],
        start_new_session=True,
    )
    try:
        meter = CpuMeter(leader.pid)
        meter.start()
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        used = meter.stop()
        assert set(used) == {"server"} and done.exists() and 0.5 <= used["server"] <= 2.0, (
            used
        )  # the child's 0.6 s burn, nothing outside the session
    finally:
        os.killpg(leader.pid, 9)
        leader.wait()


def test_cpu_figures_arithmetic():
    f = cpu_figures({"prefill": 4.0, "decode": 8.0}, completed=8, duration_s=10.0, cores=2)
    assert f == {
        "server_cpu_s": 12.0,
        "server_cpu_s_per_request": 1.5,
        "server_cpu_s_per_request_by_role": {"decode": 1.0, "prefill": 0.5},
        "server_cpu_utilization": 0.6,
        "cpu_bound_req_s": pytest.approx(2 / 1.5),
    }
    assert cpu_figures({"server": 1.0}, 0, 1.0, 2)["server_cpu_s_per_request"] == float("inf")
