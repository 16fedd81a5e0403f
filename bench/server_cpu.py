"""CPU time a server spends, read from /proc: how much of the machine a workload really takes.

`bench-compare` starts every server in a session of its own (start_new_session), so every
process the server forks (pdserve's gateway and workers, a vLLM engine core) shares that session
id; their user + system times summed give the server's CPU seconds (and, for pdserve, each
role's: its prefill, decode, gateway processes apart). Divided by the requests
served, that is its cost per request, and `cores / cost` the request rate at which it would keep
every core busy: no server of that cost can hold a higher rate on this machine, whatever its
scheduling. The time includes OpenMP threads spinning at barriers, which is CPU the server
really took from the machine.
"""

from __future__ import annotations

import os
from pathlib import Path

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _stat_fields(stat: str) -> list[str]:
    """Fields of /proc/PID/stat after the command name (which may hold spaces and parentheses):
    index 0 is field 3 (state) of proc(5)."""
    return stat[stat.rindex(")") + 2 :].split()


ROLES = ("prefill", "decode", "colocated", "gateway", "serve")  # pdserve's process kinds (`pdserve.cli ROLE`)


def _role(cmdline: bytes) -> str:
    """A pdserve process's role from its command line (`python -m pdserve.cli ROLE ...`), else
    `server`: a peer's processes are counted together."""
    args = cmdline.split(b"\0")
    if b"pdserve.cli" in args:
        rest = args[args.index(b"pdserve.cli") + 1 :]
        if rest and rest[0].decode(errors="replace") in ROLES:
            return rest[0].decode()
    return "server"


def session_cpu_by_role(sid: int, proc: Path = Path("/proc")) -> dict[str, float]:
    """User + system CPU seconds of every live process in session `sid`, summed per role."""
    totals: dict[str, float] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields((entry / "stat").read_text())
            if int(fields[3]) != sid:  # field 6: session id
                continue
            role = _role((entry / "cmdline").read_bytes())
        except (OSError, ValueError):
            continue  # exited between listing and reading
        ticks = int(fields[11]) + int(fields[12])  # fields 14, 15: utime, stime (clock ticks)
        totals[role] = totals.get(role, 0.0) + ticks / _CLK_TCK
    return totals


class CpuMeter:
    """CPU seconds a session's processes take between `start()` and `stop()`, per role.

    A process that exits in between loses its time from the sum (its parent reaps it), so the
    figure is for servers whose processes live through the measurement, as they do in a bench."""

    def __init__(self, sid: int, proc: Path = Path("/proc")):
        self.sid, self.proc = sid, proc
        self._t0: dict[str, float] = {}

    def start(self) -> None:
        self._t0 = session_cpu_by_role(self.sid, self.proc)

    def stop(self) -> dict[str, float]:
        now = session_cpu_by_role(self.sid, self.proc)
        return {role: now[role] - self._t0.get(role, 0.0) for role in now}


def cpu_figures(by_role: dict[str, float], completed: int, duration_s: float, cores: int) -> dict:
    """Result keys for one run: CPU seconds in all and per role, per completed request (in all
    and per role), the share of the machine taken, and the rate at which this cost per request
    would fill every core."""
    cpu_s = sum(by_role.values())
    per_request = cpu_s / completed if completed else float("inf")
    return {
        "server_cpu_s": cpu_s,
        "server_cpu_s_per_request": per_request,
        "server_cpu_s_per_request_by_role": {
            r: s / completed if completed else float("inf") for r, s in sorted(by_role.items())
        },
        "server_cpu_utilization": cpu_s / (duration_s * cores) if duration_s > 0 else 0.0,
        "cpu_bound_req_s": cores / per_request if per_request > 0 else float("inf"),
    }
