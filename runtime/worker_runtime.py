"""What every worker process does besides running its engine: membership and messaging.

A worker binds one control inbox (PULL), connects one outbox (PUSH) to each configured gateway,
announces itself with `Register` until a gateway answers `Welcome`, then heartbeats with its
stats. Replies for a request go to the gateway named in it (by id, mapped to a configured
address: never an address taken from a request).

Heartbeats come from a thread of their own (own sockets), so a long engine step (a 2048-token
prefill on one core takes seconds) never looks like a dead worker; the engine loop only
publishes a stats snapshot. A stuck loop still shows: `last_step_age_s` keeps growing while
work is pending, and the gateway treats a worker stuck past its limit as dead. A stopped or
killed process sends nothing, which the gateway notices within ~2 s.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any, Callable

import msgspec
import zmq

from pdserve.engine.engine_core import EngineCore, EngineInfo, EngineStats
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.block_hashes import short_id
from pdserve.protocol.channel import Inbox, Outbox
from pdserve.protocol.messages import (
    Deregister,
    Heartbeat,
    KvDigest,
    KvLayout,
    Message,
    Register,
    Role,
    TokenOutput,
    TokenOutputBatch,
    Welcome,
    WorkerInfo,
    WorkerStats,
    decode_to_worker,
)

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
REGISTER_INTERVAL_S = 1.0
KV_FULL_EVERY_S = 5.0  # a worker's whole prefix-cache set goes out this often (deltas between)

# (registered?, block id) changes since the last report, and now and then the whole set of ids
KvChanges = tuple[list[tuple[bool, int]], list[int] | None]
# the request ids a worker holds, and of them those only leased (a decode worker's, KV awaited)
HeldRequests = tuple[list[str], list[str]]


class PrefixCacheReport:
    """Drains an engine's prefix-cache events (EngineCore.prefix_cache_changes) as block ids
    (`short_id`) for heartbeats, with the whole set every KV_FULL_EVERY_S."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        engine.prefix_cache_changes()  # recording starts now
        self._full_at = 0.0

    def __call__(self) -> KvChanges:
        events = self.engine.prefix_cache_changes()
        now = time.monotonic()
        full = None
        if now - self._full_at >= KV_FULL_EVERY_S:
            self._full_at = now
            full = [short_id(h) for h in self.engine.prefix_cache_hashes()]
        return [(stored, short_id(h)) for stored, h in events], full


def new_worker_id(role: Role) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def gpu_uuid(device: str) -> str:
    """The UUID of the GPU `device` is (the same in every process), or "" for the CPU: where a
    worker's KV lives, for the gateway's choice of CUDA IPC (WorkerInfo.kv_device)."""
    if not device.startswith("cuda"):
        return ""
    import torch

    return str(torch.cuda.get_device_properties(torch.device(device)).uuid)


def describe_worker(info: EngineInfo, role: Role, control_addr: str, host: str, **extra: Any) -> WorkerInfo:
    """The WorkerInfo a worker registers with: identity, addresses, model and KV pool shape."""
    layout = KvLayout(
        info.num_layers,
        info.num_blocks,
        info.block_size,
        info.num_kv_heads,
        info.head_dim,
        info.kv_dtype,
        draft_fingerprint=info.draft_fingerprint or "",
    )
    return WorkerInfo(
        worker_id=new_worker_id(role),
        role=role,
        control_addr=control_addr,
        host=host,
        pid=os.getpid(),
        model_fingerprint=info.model_fingerprint,
        kv_layout=layout,
        max_model_len=info.max_model_len,
        max_num_seqs=info.max_num_seqs,
        kv_device=gpu_uuid(info.device),
        **extra,
    )


def engine_stats(
    stats: EngineStats, last_progress: float, dropped_frames: int, extra_waiting: int = 0, **lease_stats: Any
) -> WorkerStats:
    """Heartbeat stats from the engine's (EngineCore.stats) and the worker's own counters;
    `last_step_age_s` grows only while there is work and no step completes."""
    return WorkerStats(
        kv_blocks_free=stats.num_free_blocks,
        kv_blocks_total=stats.num_blocks,
        kv_blocks_cached=stats.num_cached_blocks,
        prefix_query_tokens=stats.prefix_query_tokens,
        prefix_hit_tokens=stats.prefix_hit_tokens,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting + extra_waiting,
        steps=stats.steps,
        preemptions=stats.preemptions,
        seq_limit=stats.seq_limit,
        last_step_age_s=time.monotonic() - last_progress if stats.has_work else 0.0,
        dropped_frames=dropped_frames,
        structured_mask_rows=stats.structured_mask_rows,
        structured_mask_seconds=stats.structured_mask_seconds,
        **stats.kv_disk,
        **lease_stats,
    )


class Heartbeater:
    """Sends `Heartbeat(latest stats)` to every gateway every HEARTBEAT_INTERVAL_S from a daemon
    thread with its own PUSH sockets (ZMQ sockets are not shared across threads)."""

    def __init__(self, ctx: zmq.Context, auth: FrameAuth, gateway_addrs: list[str]) -> None:
        self._ctx, self._auth, self._addrs = ctx, auth, list(gateway_addrs)
        self._lock = threading.Lock()
        self._snapshot: tuple[WorkerInfo, WorkerStats, float] | None = None
        self._held: HeldRequests | None = None  # as of the snapshot (None: the worker does not tell)
        self._snapshots = 0  # publishes so far: numbers the snapshot in each heartbeat
        self._step_at = 0.0  # when the loop last began an engine step (monotonic)
        self._progress_at = 0.0  # when a step in progress last finished a layer (monotonic)
        # the prefix-cache digest to send next (KvDigest): whole set, or changes since the last
        self._kv_seq = 0
        self._kv_full: set[int] | None = None
        self._kv_stored: list[int] = []
        self._kv_removed: list[int] = []
        self._kv_reported = False  # the loop reports a prefix cache: every heartbeat carries a digest
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def publish(
        self, info: WorkerInfo, stats: WorkerStats, kv: KvChanges | None = None, held: HeldRequests | None = None
    ) -> None:
        """Called by the engine loop: the stats to send until the next publish, what changed
        in its prefix cache since the last publish (with, now and then, the whole set), and the
        requests it holds now (for the gateway's reconciliation)."""
        with self._lock:
            self._snapshot = (info, stats, time.monotonic())
            self._held = held
            self._snapshots += 1
            if kv is None:
                return
            self._kv_reported = True
            events, full = kv
            if full is not None:  # taken after the events: they are in it
                self._kv_full, self._kv_stored, self._kv_removed = set(full), [], []
            elif self._kv_full is not None:
                for stored, block_id in events:
                    (self._kv_full.add if stored else self._kv_full.discard)(block_id)
            else:
                for stored, block_id in events:
                    (self._kv_stored if stored else self._kv_removed).append(block_id)

    def _digest(self) -> KvDigest | None:
        """The next digest (under the lock); numbered, so a gateway that missed one knows."""
        if not self._kv_reported:
            return None
        self._kv_seq += 1
        if self._kv_full is not None:
            digest = KvDigest(seq=self._kv_seq, full=True, stored=sorted(self._kv_full))
        else:
            digest = KvDigest(seq=self._kv_seq, stored=self._kv_stored, removed=self._kv_removed)
        self._kv_full, self._kv_stored, self._kv_removed = None, [], []
        return digest

    def mark_step(self) -> None:
        """Called by the engine loop as it begins a step: a step that began after the latest
        snapshot and has not let the loop publish since is in progress (maybe stuck)."""
        self._step_at = time.monotonic()  # one float store: atomic, no lock needed

    def mark_progress(self) -> None:
        """Called as a step finishes a layer (from whichever thread runs it): a long step that
        goes on finishing layers is making progress, not stuck (a real-size model's prefill of
        thousands of tokens on a few cores takes minutes; each layer, seconds)."""
        self._progress_at = time.monotonic()

    def ensure_started(self) -> None:
        if self._thread.ident is None and not self._stop.is_set():  # a thread starts once
            self._thread.start()

    def _current(self) -> Heartbeat | None:
        with self._lock:
            snap, held, number = self._snapshot, self._held, self._snapshots
            digest = self._digest() if snap is not None else None
        if snap is None:
            return None
        info, stats, taken = snap
        age = self._age(stats, taken)
        if age != stats.last_step_age_s:
            stats = msgspec.structs.replace(stats, last_step_age_s=age)
        if held is None:
            return Heartbeat(worker_id=info.worker_id, stats=stats, info=info, kv=digest)
        return Heartbeat(
            worker_id=info.worker_id,
            stats=stats,
            info=info,
            kv=digest,
            requests=held[0],
            leases=held[1],
            snapshot=number,
        )

    def _age(self, stats: WorkerStats, taken: float) -> float:
        """How long the engine loop has had work pending without completing a step, now."""
        now = time.monotonic()
        age = stats.last_step_age_s
        if age > 0:  # work was pending: the loop's silence since counts too
            age += now - taken
        step_at = self._step_at
        if step_at > taken:  # a step began after the snapshot (work arrived while idle) and runs on
            age = max(age, now - step_at)
        progress_at = self._progress_at
        if progress_at > 0:  # a step finished a layer then (lanes run steps while the loop ticks on)
            age = min(age, now - progress_at)
        return age

    def step_age(self) -> float:
        """`last_step_age_s` as a heartbeat sent now would carry it (0 before any snapshot)."""
        with self._lock:
            snap = self._snapshot
        return 0.0 if snap is None else self._age(snap[1], snap[2])

    def _run(self) -> None:
        boxes = [Outbox(self._ctx, self._auth, addr) for addr in self._addrs]
        try:
            while not self._stop.wait(HEARTBEAT_INTERVAL_S):
                hb = self._current()
                if hb is not None:
                    for box in boxes:
                        box.send(msgspec.structs.replace(hb, via=box.addr))
        finally:
            for box in boxes:
                box.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)


class WorkerRuntime:
    def __init__(self, ctx: zmq.Context, auth: FrameAuth, control_bind: str, gateway_addrs: list[str]) -> None:
        if not gateway_addrs:
            raise ValueError("a worker needs at least one --gateway address")
        self.ctx = ctx
        self.inbox = Inbox(ctx, auth, control_bind, decoder=decode_to_worker)
        self._poller: zmq.Poller | None = None  # inbox + what drain's `wake` names
        self._by_addr = {addr: Outbox(ctx, auth, addr) for addr in gateway_addrs}
        self._by_id: dict[str, Outbox] = {}
        self._welcomed: set[str] = set()
        self._last_register = 0.0
        self._last_publish = 0.0
        self._heartbeater = Heartbeater(ctx, auth, gateway_addrs)
        self._held: dict[str, list[TokenOutput]] = {}  # gateway id -> outputs not yet sent
        self.info: WorkerInfo | None = None
        self._deregistered = False

    @property
    def control_addr(self) -> str:
        return self.inbox.addr

    def handle_welcome(self, msg: Welcome) -> None:
        box = self._by_addr.get(msg.inbox_addr)  # the address we registered through (Register.via)
        if box is None:
            log.warning("Welcome names unknown gateway address %s: ignored", msg.inbox_addr)
            return
        self._by_id[msg.gateway_id] = box
        self._welcomed.add(msg.inbox_addr)

    def to_gateway(self, gateway_id: str, msg: Message) -> bool:
        box = self._by_id.get(gateway_id)
        if box is None:
            log.warning("no route to gateway %s; dropping %s", gateway_id, type(msg).__name__)
            return False
        return box.send(msg)

    def hold_output(self, gateway_id: str, out: TokenOutput) -> None:
        """Queue `out` for its gateway; `flush_outputs` sends everything held, one frame a gateway."""
        self._held.setdefault(gateway_id, []).append(out)

    def flush_outputs(self) -> None:
        """One message per gateway for everything held: a step of 32 sequences costs one HMAC,
        one send and one gateway wake-up instead of 32."""
        held, self._held = self._held, {}
        for gateway_id, outs in held.items():
            self.to_gateway(gateway_id, outs[0] if len(outs) == 1 else TokenOutputBatch(outputs=outs))

    def tick(
        self,
        stats: Callable[[], WorkerStats],
        kv: Callable[[], KvChanges] | None = None,
        held: Callable[[], HeldRequests | None] | None = None,
    ) -> None:
        """Register with gateways that have not welcomed us; publish stats (prefix-cache changes,
        the requests held) for the heartbeat thread (started on the first tick)."""
        assert self.info is not None, "set runtime.info before the loop"
        now = time.monotonic()
        if now - self._last_register >= REGISTER_INTERVAL_S:
            self._last_register = now
            for addr, box in self._by_addr.items():
                if addr not in self._welcomed:
                    box.send(Register(info=self.info, via=addr))
        if now - self._last_publish >= HEARTBEAT_INTERVAL_S / 5:
            self._last_publish = now
            self._heartbeater.publish(
                self.info, stats(), kv() if kv is not None else None, held() if held is not None else None
            )
            self._heartbeater.ensure_started()

    def mark_step(self) -> None:
        """The loop is about to run an engine step: lets heartbeats report a step that never
        returns even when the last published stats said idle (work arrived, then the loop stuck)."""
        self._heartbeater.mark_step()

    def mark_progress(self) -> None:
        """A step in progress finished a layer (any thread): `Heartbeater.mark_progress`."""
        self._heartbeater.mark_progress()

    def drain(self, timeout_ms: int, wake: Sequence[int | zmq.Socket] = ()) -> list[Message]:
        """Messages now waiting; blocks up to `timeout_ms` for the first one, or until one of
        `wake` (pipes the caller's own threads write to, sockets it serves) is readable. The
        first call's `wake` holds for every later one."""
        if wake and timeout_ms:
            if self._poller is None:
                self._poller = zmq.Poller()
                for w in [self.inbox.socket, *wake]:
                    self._poller.register(w, zmq.POLLIN)
            self._poller.poll(timeout_ms)
            timeout_ms = 0
        msgs = []
        msg = self.inbox.recv_one(timeout_ms)
        while msg is not None:
            msgs.append(msg)
            msg = self.inbox.recv_one(0)
        return msgs

    def deregister(self, reason: str) -> None:
        """Leave every gateway: heartbeats stop first (a later one would re-register us), then
        `Deregister`, given a second to go out when the sockets close."""
        self._heartbeater.close()
        if self.info is None:
            return
        for box in self._by_addr.values():
            box.send(Deregister(worker_id=self.info.worker_id, reason=reason))
        self._deregistered = True

    def step_age(self) -> float:
        return self._heartbeater.step_age()

    @property
    def welcomed(self) -> bool:
        """At least one gateway has answered our registration."""
        return bool(self._welcomed)

    def close(self) -> None:
        self._heartbeater.close()
        self.inbox.close()
        linger = 1000 if self._deregistered else 0
        for box in self._by_addr.values():
            box.close(linger_ms=linger)
