"""Decode and colocated workers' settings (planned by cli/topology.py, passed as one struct)."""

from __future__ import annotations

from typing import Annotated

from pdserve.engine.config import EngineConfig
from pdserve.flag import Flag, positive_float
from pdserve.runtime.worker_settings import KvPayloadMac, WorkerSettings

DEFAULT_LEASE_TTL_S = 30.0


class DecodeSettings(WorkerSettings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    engine: EngineConfig
    kv_bind: Annotated[str, Flag("inbox for KV frames")] = "tcp://127.0.0.1:0"
    # e.g. a NAT/forwarded address or a test's fault-injection relay
    kv_advertise: Annotated[
        str | None,
        Flag(
            "KV address sent in the registration for prefill workers to connect to "
            "(default: the bound --kv-bind address)"
        ),
    ] = None
    # the KV pool in POSIX shared memory (prefill writes it in place)
    shared_memory: Annotated[bool, Flag("plain (not shared) KV memory", name="--no-shm")] = True
    lease_ttl_s: Annotated[
        float,
        Flag(
            "seconds a decode worker's KV reservation stays valid (and quarantined after an abort)", name="--lease-ttl"
        ),
    ] = DEFAULT_LEASE_TTL_S
    # HMAC tag required over each KV payload (kvtransfer/wire.py): auto = on when the KV inbox is tcp://
    kv_payload_mac: KvPayloadMac = "auto"
    # torch threads for steps taken while no prefill for this worker is in flight
    # (decode_node/thread_lending.py); None: `threads`, i.e. no lending
    idle_threads: Annotated[
        int | None,
        Flag(
            "torch threads while no prefill for this worker is in flight, borrowing the prefill pool's cores on "
            "a shared machine (default, alone on a machine: --threads)",
            planned=True,
        ),
    ] = None
    # decode_node/step_pacing.py; 0 = back to back
    step_interval_ms: Annotated[
        float,
        Flag(
            "while prompts for this worker queue behind a prefill, space decode steps up to this far apart (at a "
            "queue of 2 prompts), leaving the gaps to prefill (0, the default for a worker alone on its machine: "
            "back to back)",
            planned=True,
        ),
    ] = 0.0
    # adaptive admission (decode_node/aimd.py): the limit on running sequences moves between this
    # and engine.scheduler.max_num_seqs by AIMD against tpot_target_ms; None = fixed at the max
    min_num_seqs: Annotated[
        int | None,
        Flag(
            "adapt each decode worker's limit on running sequences between this and --max-num-seqs: additive "
            "increase while steps meet --tpot-slo-ms (default 60) without preemption, halved on a preemption or "
            "a breach; the gateway admits by the current limit (default: fixed at --max-num-seqs)"
        ),
    ] = None
    tpot_target_ms: Annotated[
        float,
        Flag(
            "the time-per-output-token target decode steps are held to (adaptive admission, step pacing)",
            name="--tpot-slo-ms",
            parse=positive_float,
        ),
    ] = 60.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.min_num_seqs is not None and not 1 <= self.min_num_seqs <= self.engine.scheduler.max_num_seqs:
            raise ValueError(
                f"min_num_seqs must be in [1, max_num_seqs={self.engine.scheduler.max_num_seqs}], got {self.min_num_seqs}"
            )
        if not self.tpot_target_ms > 0:
            raise ValueError(f"tpot_target_ms must be > 0, got {self.tpot_target_ms}")
        if not self.lease_ttl_s > 0:
            raise ValueError(f"lease_ttl_s must be > 0, got {self.lease_ttl_s}")
        if self.step_interval_ms < 0:
            raise ValueError(f"step_interval_ms must be >= 0, got {self.step_interval_ms}")
        if self.idle_threads is not None and self.idle_threads < 1:
            raise ValueError(f"idle_threads must be >= 1, got {self.idle_threads}")


class ColocatedSettings(WorkerSettings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    engine: EngineConfig
