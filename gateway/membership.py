"""Which workers exist, which are alive, and how loaded they are (from Register/Heartbeat).

Alive (`is_live`): heard within its silence allowance, engine loop not stuck, not deregistered;
requests a worker holds are watched by this. The allowance (`dead_after`) is `dead_after_s`, or
GAP_FACTOR times the longest silence between its heartbeats seen lately if that is more (a worker
whose heartbeats come late under load, as a real-size model's long steps on shared cores make
them, is given room by its own record), never past `stuck_after_s`. A worker on this host whose
process is running (not stopped, not a zombie) is given `stuck_after_s` of silence: it is busy,
not gone. Time the gateway's own loop spent away (`credit_pause`) counts against no one. Routable (`live(role)`): alive and not draining; new requests
go only there. A worker that deregistered is forgotten, and a heartbeat of it still in flight
(sent on another socket just before) does not bring it back.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.protocol.messages import WorkerInfo, WorkerStats

log = logging.getLogger(__name__)

GAP_FACTOR = 2.0  # silence allowed, in multiples of the longest recent gap between heartbeats
GAP_DECAY = 0.98  # per heartbeat: the longest gap seen fades over ~100 heartbeats (~50 s)
THIS_HOST = socket.gethostname()


def process_running(pid: int) -> bool:
    """Whether process `pid` of this host exists and is neither stopped nor a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]  # the field after the command's name
    except (OSError, IndexError):
        return False
    return state not in ("T", "t", "Z", "X")


@dataclass
class WorkerEntry:
    info: WorkerInfo
    stats: WorkerStats = field(default_factory=WorkerStats)
    last_seen: float = field(default_factory=time.monotonic)
    inflight: int = 0  # requests this gateway has routed here and not yet finished
    reserving: int = 0  # reservations this gateway has asked of it and not yet heard back on
    gone: bool = False  # deregistered
    # what its loop last said it holds (Heartbeat.requests; None: it does not tell), the leases
    # among them (KV awaited), and that report's number (gateway/reconcile.py)
    held: frozenset[str] | None = None
    leased: frozenset[str] = frozenset()
    snapshot: int = 0
    longest_gap: float = 0.0  # the longest silence between its heartbeats lately (decaying), s

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def draining(self) -> bool:
        return self.stats.draining


STUCK_AFTER_S = 30.0  # the one default of --stuck-after (GatewayOptions, ClusterBackend, WorkerTable)


class WorkerTable:
    """Liveness = a heartbeat within `dead_after_s`; a stuck engine loop counts as dead too."""

    def __init__(self, dead_after_s: float = 2.0, stuck_after_s: float = STUCK_AFTER_S) -> None:
        self.dead_after_s = dead_after_s
        self.stuck_after_s = stuck_after_s
        self.workers: dict[str, WorkerEntry] = {}
        self.departed: OrderedDict[str, None] = OrderedDict()  # deregistered ids (the latest few)

    def upsert(self, info: WorkerInfo, stats: WorkerStats | None = None) -> bool | None:
        """Record a worker; True when it is new to this table, None when it has deregistered."""
        if info.worker_id in self.departed:
            return None
        entry = self.workers.get(info.worker_id)
        if entry is None:
            self.workers[info.worker_id] = WorkerEntry(info, stats or WorkerStats())
            return True
        entry.info = info
        now = time.monotonic()
        gap = now - entry.last_seen
        if gap > self.dead_after_s / 2:
            log.warning("heard from %s after %.1f s of silence", info.worker_id, gap)
        entry.longest_gap = max(gap, entry.longest_gap * GAP_DECAY)
        entry.last_seen = now
        if stats is not None:
            entry.stats = stats
        return False

    def remove(self, worker_id: str) -> WorkerEntry | None:
        """Forget a worker that deregistered; its id is never taken back."""
        entry = self.workers.pop(worker_id, None)
        if entry is not None:
            entry.gone = True
        self.departed[worker_id] = None
        while len(self.departed) > 4096:
            self.departed.popitem(last=False)
        return entry

    def dead_after(self, entry: WorkerEntry) -> float:
        """The silence after which `entry` counts as gone (the module docstring)."""
        return min(self.stuck_after_s, max(self.dead_after_s, GAP_FACTOR * entry.longest_gap))

    def is_live(self, entry: WorkerEntry, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        if entry.gone or entry.stats.last_step_age_s > self.stuck_after_s:
            return False
        silence = now - entry.last_seen
        if silence <= self.dead_after(entry):
            return True
        info = entry.info
        return silence <= self.stuck_after_s and info.host == THIS_HOST and process_running(info.pid)

    def why_gone(self, entry: WorkerEntry, now: float | None = None) -> str:
        """Why `is_live` says no, in words (for the log line that moves its requests)."""
        now = time.monotonic() if now is None else now
        if entry.gone:
            return "deregistered"
        if entry.stats.last_step_age_s > self.stuck_after_s:
            return f"no engine progress for {entry.stats.last_step_age_s:.1f} s with work pending"
        return f"silent for {now - entry.last_seen:.1f} s (allowed {self.dead_after(entry):.1f} s)"

    def credit_pause(self, seconds: float) -> None:
        """The gateway's own loop was away `seconds` (blocked, or starved of the CPU): heartbeats
        that arrived meanwhile wait unread, so that time counts against no worker."""
        for entry in self.workers.values():
            entry.last_seen += seconds

    def live(self, role: str) -> list[WorkerEntry]:
        """Alive workers of `role` that take new requests (not draining)."""
        now = time.monotonic()
        return [w for w in self.workers.values() if w.info.role == role and self.is_live(w, now) and not w.draining]

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self.workers.get(worker_id)
