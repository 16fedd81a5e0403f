"""How long a worker may be silent before the gateway counts it gone (gateway/membership.py): the
base window, widened by the worker's own record of late heartbeats, `stuck_after_s` for a worker
process running on this host (busy, not gone), never for a stopped, dead or remote one; and time
the gateway's own loop was away counts against no one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pdserve.gateway.membership import GAP_FACTOR, THIS_HOST, WorkerEntry, WorkerTable, process_running
from pdserve.protocol.messages import KvLayout, WorkerInfo


def entry(host: str = "elsewhere", pid: int = 1) -> WorkerEntry:
    info = WorkerInfo("p-1", "prefill", "ipc://p", host, pid, "m", KvLayout(1, 8, 16, 1, 8, "float32"))
    return WorkerEntry(info)


def silent_for(e: WorkerEntry, seconds: float) -> float:
    now = time.monotonic()
    e.last_seen = now - seconds
    return now


def test_a_remote_worker_is_gone_after_the_base_window():
    table, e = WorkerTable(dead_after_s=2.0, stuck_after_s=30.0), entry()
    assert table.is_live(e, silent_for(e, 1.9))
    assert not table.is_live(e, silent_for(e, 2.1))


def test_late_heartbeats_widen_the_window_up_to_the_stuck_limit():
    table, e = WorkerTable(dead_after_s=2.0, stuck_after_s=30.0), entry()
    table.workers[e.worker_id] = e
    e.last_seen = time.monotonic() - 1.5  # its heartbeats come late
    table.upsert(e.info)
    assert 1.5 <= e.longest_gap < 1.6
    assert table.dead_after(e) == GAP_FACTOR * e.longest_gap
    assert table.is_live(e, silent_for(e, 0.95 * GAP_FACTOR * 1.5))  # past the base 2 s
    assert not table.is_live(e, silent_for(e, 1.05 * GAP_FACTOR * 1.6))
    e.longest_gap = 60.0
    assert table.dead_after(e) == 30.0
    for _ in range(400):  # on time again: the record fades back to the base window
        table.upsert(e.info)
    assert table.dead_after(e) == 2.0


def test_a_running_process_on_this_host_is_busy_not_gone():
    table = WorkerTable(dead_after_s=2.0, stuck_after_s=30.0)
    e = entry(THIS_HOST, os.getpid())
    assert table.is_live(e, silent_for(e, 10.0))
    assert not table.is_live(e, silent_for(e, 31.0))  # silent past the stuck limit: gone
    e.stats = e.stats.__class__(last_step_age_s=31.0)
    assert not table.is_live(e, silent_for(e, 0.0))  # its loop says it is stuck


def test_a_stopped_dead_or_remote_process_is_gone():
    table = WorkerTable(dead_after_s=2.0, stuck_after_s=30.0)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert process_running(child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.2)
        assert not process_running(child.pid)  # a stopped worker answers nothing
        stopped = entry(THIS_HOST, child.pid)
        assert not table.is_live(stopped, silent_for(stopped, 3.0))
    finally:
        child.kill()
        child.wait()
    assert not process_running(child.pid)
    remote = entry("another-host", os.getpid())
    assert not table.is_live(remote, silent_for(remote, 3.0))


def test_time_the_gateway_was_away_counts_against_no_one():
    table, e = WorkerTable(dead_after_s=2.0, stuck_after_s=30.0), entry()
    table.workers[e.worker_id] = e
    now = silent_for(e, 3.0)
    assert not table.is_live(e, now)
    table.credit_pause(2.5)  # the loop was blocked 2.5 s: the heartbeats of that time wait unread
    assert table.is_live(e, now)
