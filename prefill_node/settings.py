"""A prefill worker's settings (planned by cli/topology.py, passed as one struct)."""

from __future__ import annotations

from typing import Annotated

from pdserve.engine.config import EngineConfig
from pdserve.flag import Flag
from pdserve.runtime.worker_settings import KvPayloadMac, WorkerSettings


class PrefillSettings(WorkerSettings, frozen=True, kw_only=True, forbid_unknown_fields=True):
    engine: EngineConfig
    # HMAC over every KV payload sent over ZMQ: auto = on when the decode worker's KV address is tcp://
    kv_payload_mac: KvPayloadMac = "auto"
    lanes: Annotated[  # prefill_node/lanes.py
        int, Flag("threads that each run a prefill step (of --threads torch threads), in parallel")
    ] = 1
    idle_lanes: Annotated[  # cycles nothing else on the machine wants
        int,
        Flag(
            "more such lanes at SCHED_IDLE priority: they use only cycles no other process wants "
            "(default: the machine's cores outside --threads, in lanes of --threads)",
            planned=True,
        ),
    ] = 0
    # peers fetch the prompt blocks its prefix cache holds here (prefill_node/prefix_sharing.py)
    prefix_export_bind: Annotated[
        str, Flag("the socket peers fetch prompt blocks this worker's prefix cache holds from")
    ] = "tcp://127.0.0.1:0"
    prefix_sharing: Annotated[
        bool,
        Flag(
            "neither export prompt blocks to peer workers nor fetch those a peer holds (which the gateway "
            "suggests when fetching costs less than computing)",
            name="--no-prefix-sharing",
        ),
    ] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lanes < 1 or self.idle_lanes < 0:
            raise ValueError(f"lanes must be >= 1 and idle_lanes >= 0, got {self.lanes}, {self.idle_lanes}")
        if self.engine.tensor_parallel_size > 1 and (self.lanes, self.idle_lanes) != (1, 0):
            raise ValueError("a tensor-parallel prefill worker runs one lane (its ranks step in lockstep)")
