"""Rank 0's handle on the rank processes 1..N-1 of its tensor-parallel engine.

Each rank is `python -m pdserve.engine.parallel.worker`, its stdin a pipe from rank 0:
line 1 is its RankConfig (JSON); then one byte per step rings it to take part in that step's
collectives (so an idle rank waits on the pipe, never inside a collective that could time out);
end of file (rank 0 closed it, or died) makes it exit. It answers on stdout with one line once
its shard is loaded: `ready` or `error: ...`. Its logs go to stderr (inherited).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
import weakref

import msgspec

from pdserve.engine.parallel.group import TensorParallelError
from pdserve.engine.parallel.rank_config import RankConfig

STEP = b"s"


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Close every rank's pipe (it exits), then kill those still running after a grace period."""
    for p in procs:
        if p.stdin is not None and not p.stdin.closed:
            try:
                p.stdin.close()
            except OSError:
                pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        for f in (p.stdout,):
            if f is not None:
                f.close()


class RankProcesses:
    def __init__(self, configs: list[RankConfig]) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self._finalizer = weakref.finalize(self, _stop, self.procs)  # also at interpreter exit
        for cfg in configs:
            p = subprocess.Popen(
                [sys.executable, "-m", "pdserve.engine.parallel.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, "OMP_NUM_THREADS": str(cfg.threads)},
            )
            self.procs.append(p)
            assert p.stdin is not None
            p.stdin.write(msgspec.json.encode(cfg) + b"\n")
            p.stdin.flush()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait_ready(self, timeout_s: float) -> None:
        """Block until every rank has loaded its shard; raise if one fails, exits or takes too long."""
        deadline = time.monotonic() + timeout_s
        for rank, p in enumerate(self.procs, start=1):
            assert p.stdout is not None
            while True:
                ready, _, _ = select.select([p.stdout], [], [], min(1.0, max(0.0, deadline - time.monotonic())))
                if ready:
                    line = p.stdout.readline().decode(errors="replace").strip()
                    if line == "ready":
                        break
                    raise TensorParallelError(f"tensor-parallel rank {rank} failed to start: {line or self.describe()}")
                if time.monotonic() >= deadline:
                    raise TensorParallelError(f"tensor-parallel rank {rank} not ready after {timeout_s:.0f}s")

    def ring(self) -> None:
        """Tell every rank a step follows; raise at once if one has gone."""
        for rank, p in enumerate(self.procs, start=1):
            assert p.stdin is not None
            try:
                p.stdin.write(STEP)
                p.stdin.flush()
            except (BrokenPipeError, ValueError):
                raise TensorParallelError(f"tensor-parallel rank {rank} is gone: {self.describe()}") from None

    def describe(self) -> str:
        """Each rank's state, for errors: `rank 1 (pid 123) exited with -9`, or running."""
        states = []
        for rank, p in enumerate(self.procs, start=1):
            code = p.poll()
            states.append(f"rank {rank} (pid {p.pid}) " + ("running" if code is None else f"exited with {code}"))
        return "; ".join(states)

    def close(self) -> None:
        self._finalizer()
