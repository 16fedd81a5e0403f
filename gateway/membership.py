"""Which workers exist, which are alive, and how loaded they are (from Register/Heartbeat).

Alive (`is_live`): heard within `dead_after_s`, engine loop not stuck, not deregistered; requests a
worker holds are watched by this. Routable (`live(role)`): alive and not draining; new requests
go only there. A worker that deregistered is forgotten, and a heartbeat of it still in flight
(sent on another socket just before) does not bring it back.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from pdserve.protocol.messages import WorkerInfo, WorkerStats


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

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def draining(self) -> bool:
        return self.stats.draining


class WorkerTable:
    """Liveness = a heartbeat within `dead_after_s`; a stuck engine loop counts as dead too."""

    def __init__(self, dead_after_s: float = 2.0, stuck_after_s: float = 30.0) -> None:
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
        entry.last_seen = time.monotonic()
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

    def is_live(self, entry: WorkerEntry, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        return (
            not entry.gone
            and now - entry.last_seen <= self.dead_after_s
            and entry.stats.last_step_age_s <= self.stuck_after_s
        )

    def live(self, role: str) -> list[WorkerEntry]:
        """Alive workers of `role` that take new requests (not draining)."""
        now = time.monotonic()
        return [w for w in self.workers.values() if w.info.role == role and self.is_live(w, now) and not w.draining]

    def get(self, worker_id: str) -> WorkerEntry | None:
        return self.workers.get(worker_id)
