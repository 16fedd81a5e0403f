"""Decode and colocated workers' settings (planned by cli/topology.py, passed as one struct)."""

from __future__ import annotations

from typing import Literal

from pdserve.engine.config import EngineConfig
from pdserve.runtime.worker_settings import WorkerSettings

DEFAULT_LEASE_TTL_S = 30.0


class DecodeSettings(WorkerSettings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    engine: EngineConfig
    kv_bind: str = "tcp://127.0.0.1:0"  # inbox for KV frames
    # the KV address put in the registration for prefill workers (default: the bound one), e.g. a
    # NAT/forwarded address or a test's fault-injection relay
    kv_advertise: str | None = None
    shared_memory: bool = True  # the KV pool in POSIX shared memory (prefill writes it in place)
    lease_ttl_s: float = DEFAULT_LEASE_TTL_S
    # HMAC tag required over each KV payload (kvtransfer/wire.py): auto = on when the KV inbox is tcp://
    kv_payload_mac: Literal["auto", "on", "off"] = "auto"
    # torch threads for steps taken while no prefill for this worker is in flight
    # (decode_node/thread_lending.py); None: `threads`, i.e. no lending
    idle_threads: int | None = None
    # while prompts for this worker queue behind a prefill, space decode steps up to this far
    # apart (decode_node/step_pacing.py); 0 = back to back
    step_interval_ms: float = 0.0
    # adaptive admission (decode_node/aimd.py): the limit on running sequences moves between this
    # and engine.scheduler.max_num_seqs by AIMD against tpot_target_ms; None = fixed at the max
    min_num_seqs: int | None = None
    tpot_target_ms: float = 60.0

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
