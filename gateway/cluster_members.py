"""Who is in the cluster, as the gateway learns it from Register, Heartbeat and Deregister: the
worker table (gateway/membership.py), what each worker's prefix cache holds (gateway/kv_index.py),
a socket to each, the leases orphaned by a lost prefill worker, and `GET /v1/workers`.

A worker heard for the first time gets `Welcome` (its route back for outputs) before any request
can reach it. A worker restarted on the same control address replaces its old entry. Leases
handed to a prefill worker lost before its first token are remembered (`orphan_lease`): if that
worker comes back it releases them itself (it gets the request's Abort); if it is replaced or
leaves, the decode worker is told nobody will write them (`Abort(lease_unused)`).

A prefill or decode worker whose KV cache dtype (--kv-cache-dtype) differs from that of the
prefill and decode workers already serving its model is refused (`Refused`; it stops): no pair
of them could exchange KV, so it would sit idle, or leave a pool with no partner.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from pdserve.gateway.kv_index import KvIndex
from pdserve.gateway.membership import WorkerEntry, WorkerTable
from pdserve.gateway.worker_plane import WorkerPlane
from pdserve.protocol.block_hashes import BlockHasher, short_id
from pdserve.protocol.kv_rows import split_fingerprint
from pdserve.protocol.messages import (
    Abort,
    Deregister,
    Heartbeat,
    Refused,
    Register,
    Welcome,
    WorkerInfo,
    WorkerStats,
)

log = logging.getLogger(__name__)

BlockMemo = dict[tuple[str, int], list[bytes]]  # a prompt's block hashes per model and block size
PAIRED_ROLES = ("prefill", "decode")  # the roles that exchange KV (colocated workers pair with none)


class ClusterMembers:
    def __init__(self, plane: WorkerPlane, gateway_id: str, table: WorkerTable, on_change: Callable[[], None]):
        self.plane, self.gateway_id, self.table = plane, gateway_id, table
        self.kv_index = KvIndex()  # what each worker's prefix cache holds, from its heartbeats
        self._on_change = on_change  # capacity may have changed (the admission queues' turn)
        # prefill worker id -> {request id: (decode worker id, lease deadline)}
        self._orphaned_leases: dict[str, dict[str, tuple[str, float]]] = {}
        self._refused: dict[str, str] = {}  # worker id -> why it was told `Refused` (then ignored)

    def on_register_or_heartbeat(self, msg: Register | Heartbeat) -> None:
        info = msg.info
        if info is None:
            return
        if info.worker_id in self._refused:  # told already; a Register means it did not hear it
            if isinstance(msg, Register):
                self.plane.send(
                    info.worker_id, Refused(gateway_id=self.gateway_id, reason=self._refused[info.worker_id])
                )
            return
        if info.worker_id not in self.table.workers and (why := self._kv_dtype_conflict(info)):
            self._refuse(info, why)
            return
        stats = msg.stats if isinstance(msg, Heartbeat) else None
        new = self.table.upsert(info, stats)
        if new is None:  # deregistered: a heartbeat sent just before, arriving late
            return
        if isinstance(msg, Heartbeat) and msg.kv is not None:
            self.kv_index.apply(info.worker_id, msg.kv)
        if isinstance(msg, Heartbeat) and msg.requests is not None:
            entry = self.table.workers[info.worker_id]
            if msg.snapshot != entry.snapshot:  # a new report of its loop (else a repeat: nothing new)
                entry.held, entry.leased, entry.snapshot = frozenset(msg.requests), frozenset(msg.leases), msg.snapshot
        joined = new or not self.plane.connected(info.worker_id)
        if joined:
            self._forget_replaced(info)
            self.plane.connect(info.worker_id, info.control_addr)
            log.info("worker %s (%s) joined at %s", info.worker_id, info.role, info.control_addr)
        # Welcome goes out before any request can be routed to a new worker (same socket, so in
        # order): a worker first heard by heartbeat (its heartbeat thread does not wait for a
        # Welcome) would otherwise take requests with no route back for their outputs.
        if joined or isinstance(msg, Register):
            self.plane.send(info.worker_id, Welcome(gateway_id=self.gateway_id, inbox_addr=msg.via or self.plane.addr))
        self._on_change()  # a worker joined or reported its load

    def _kv_dtype_conflict(self, info: WorkerInfo) -> str | None:
        """Why a joining prefill/decode worker could exchange KV with none of those serving its
        model, or None. The first such worker's --kv-cache-dtype holds for the model's pools."""
        if info.role not in PAIRED_ROLES:
            return None
        model, mine = split_fingerprint(info.model_fingerprint)
        now = time.monotonic()
        for w in self.table.workers.values():
            their_model, theirs = split_fingerprint(w.info.model_fingerprint)
            same_model = w.info.role in PAIRED_ROLES and their_model == model
            if same_model and theirs != mine and self.table.is_live(w, now):
                return (
                    f"its --kv-cache-dtype is {mine}, and {w.info.role} worker {w.worker_id} serving the same "
                    f"model holds {theirs}: prefill and decode workers of one model must store KV alike"
                )
        return None

    def _refuse(self, info: WorkerInfo, why: str) -> None:
        log.error("%s worker %s at %s refused: %s", info.role, info.worker_id, info.control_addr, why)
        self._refused[info.worker_id] = why
        self.plane.connect(info.worker_id, info.control_addr)  # closed when it deregisters
        self.plane.send(info.worker_id, Refused(gateway_id=self.gateway_id, reason=why))

    def on_deregister(self, msg: Deregister) -> None:
        """A worker leaves: route nothing more to it; requests it still held (a drain that timed
        out) see it gone at the next liveness check and move on as after a death."""
        if self._refused.pop(msg.worker_id, None) is not None:
            self.plane.disconnect(msg.worker_id)
        entry = self.table.remove(msg.worker_id)
        if entry is None:
            return
        self.kv_index.forget(msg.worker_id)
        self.plane.disconnect(msg.worker_id)
        log.info("worker %s (%s) left: %s", msg.worker_id, entry.info.role, msg.reason or "deregistered")
        self._release_orphans(msg.worker_id)
        self._on_change()

    def _forget_replaced(self, info: WorkerInfo) -> None:
        """A worker restarted on the same control address replaces the old entry: stop routing
        to the dead id (its outbox would now reach the new process)."""
        for old_id, entry in list(self.table.workers.items()):
            if old_id != info.worker_id and entry.info.control_addr == info.control_addr:
                del self.table.workers[old_id]
                self.kv_index.forget(old_id)
                self.plane.disconnect(old_id)
                log.info("worker %s replaced by %s at %s", old_id, info.worker_id, info.control_addr)
                self._release_orphans(old_id)

    # --- orphaned leases --------------------------------------------------------------------
    def orphan_lease(self, prefill_id: str, request_id: str, decode_id: str, deadline: float) -> None:
        """Remember a lease handed to a prefill worker we lost before its first token."""
        now = time.time()
        for pid in list(self._orphaned_leases):  # forget what the lease deadline has settled
            live = {r: v for r, v in self._orphaned_leases[pid].items() if v[1] > now}
            if live:
                self._orphaned_leases[pid] = live
            else:
                del self._orphaned_leases[pid]
        self._orphaned_leases.setdefault(prefill_id, {})[request_id] = (decode_id, deadline)
        if prefill_id not in self.table.workers:  # already replaced while we waited
            self._release_orphans(prefill_id)

    def _release_orphans(self, prefill_id: str) -> None:
        for request_id, (decode_id, _) in self._orphaned_leases.pop(prefill_id, {}).items():
            log.info("lease of %s on %s: prefill worker %s is gone, handing it back", request_id, decode_id, prefill_id)
            self.plane.send(decode_id, Abort(request_id=request_id, reason="prefill worker gone", lease_unused=True))

    # --- what workers hold of a prompt --------------------------------------------------------
    def block_hashes(self, prompt: list[int], info: WorkerInfo, memo: BlockMemo) -> list[bytes]:
        key = (info.model_fingerprint, info.kv_layout.block_size)
        if key not in memo:
            memo[key] = BlockHasher(*key).hashes(prompt)
        return memo[key]

    def held_blocks(self, w: WorkerEntry, prompt: list[int], memo: BlockMemo) -> int:
        """How many of the prompt's leading blocks `w` holds, as its heartbeats tell (a hint)."""
        ids = [short_id(h) for h in self.block_hashes(prompt, w.info, memo)]
        return self.kv_index.leading_blocks(w.worker_id, ids)

    # --- GET /v1/workers --------------------------------------------------------------------
    def listing(self) -> list[dict]:
        now = time.monotonic()
        out = []
        for w in self.table.workers.values():
            st = w.stats
            alive = self.table.is_live(w, now)
            out.append(
                {
                    "id": w.worker_id,
                    "role": w.info.role,
                    "state": ("draining" if w.draining else "ready") if alive else "unresponsive",
                    "control_addr": w.info.control_addr,
                    "kv_addr": w.info.kv_addr,
                    "host": w.info.host,
                    "pid": w.info.pid,
                    "last_heard_s": round(now - w.last_seen, 3),
                    "load": {
                        "routed_requests": w.inflight,
                        "running": st.num_running,
                        "waiting": st.num_waiting,
                        "max_num_seqs": w.info.max_num_seqs,
                        "leases_active": st.leases_active,
                        "steps": st.steps,
                    },
                    "kv": {
                        "blocks_total": st.kv_blocks_total,
                        "blocks_used": st.kv_blocks_total - st.kv_blocks_free,
                        "blocks_cached": st.kv_blocks_cached,
                        "usage": round(1 - st.kv_blocks_free / st.kv_blocks_total, 4) if st.kv_blocks_total else 0.0,
                        "device": f"cuda (GPU {w.info.kv_device})" if w.info.kv_device else "cpu",
                        # how prefill workers on its host write its pool in place (None: they send frames)
                        "shared_as": ("cuda-ipc" if w.info.kv_device else "shm") if w.info.shm_name else None,
                        "disk": _disk_tier(st),
                        "peers": _prefix_sharing(w.info.export_addr, st),
                    },
                }
            )
        return sorted(out, key=lambda w: (w["role"], w["id"]))


def _disk_tier(st: WorkerStats) -> dict | None:
    """The prefix cache's disk tier as GET /v1/workers shows it (None: the worker has none)."""
    if not st.kv_disk_capacity_bytes:
        return None
    return {
        "blocks": st.kv_disk_blocks,
        "bytes": st.kv_disk_bytes,
        "capacity_bytes": st.kv_disk_capacity_bytes,
        "usage": round(st.kv_disk_bytes / st.kv_disk_capacity_bytes, 4),
        "hit_tokens": st.kv_disk_hit_tokens,
        "written_bytes": st.kv_disk_write_bytes,
        "read_bytes": st.kv_disk_read_bytes,
        "evictions": st.kv_disk_evictions,
        "corrupt": st.kv_disk_corrupt,
    }


def _prefix_sharing(export_addr: str | None, st: WorkerStats) -> dict | None:
    """Prefix blocks fetched from peers and exported to them, as GET /v1/workers shows it (None:
    the worker shares none)."""
    if export_addr is None:
        return None
    return {
        "export_addr": export_addr,
        "fetches": st.prefix_fetches,
        "fetched_blocks": st.prefix_fetch_blocks,
        "fetched_bytes": st.prefix_fetch_bytes,
        "fetch_failures": st.prefix_fetch_failures,
        "exports": st.prefix_exports,
        "exported_blocks": st.prefix_export_blocks,
        "exported_bytes": st.prefix_export_bytes,
    }
