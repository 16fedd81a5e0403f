"""What a worker process is started with: one typed, validated struct per role.

`pdserve serve` plans every child's settings (cli/topology.py) and hands each its struct as a
JSON file (`pdserve prefill --settings FILE`); `pdserve prefill|decode|colocated` started alone
builds the same struct from its flags through the same planner. A field that is missing, of
the wrong type, unknown, or out of range fails at start with a message naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec


class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What every worker role has: where it listens, which gateways it reports to, its threads."""

    control_bind: str = "tcp://127.0.0.1:0"  # this worker's control inbox
    gateways: list[str]  # gateway inbox addresses (at least one)
    host: str  # the host name peers compare to decide on shared memory
    threads: int | None = None  # torch threads (None: torch's default)
    # SIGTERM drains: no new requests, those held finish; past this many seconds the rest are
    # handed off (the gateway moves them to live workers) and the worker exits
    drain_timeout_s: float = 30.0
    # HOST:PORT of a small HTTP server with /health/live and /health/ready (probes); None = none
    health_bind: str | None = None
    otlp_traces_endpoint: str | None = None  # OpenTelemetry traces go here (pdserve/tracing.py)

    def __post_init__(self) -> None:
        if not self.gateways:
            raise ValueError("a worker needs at least one gateway address")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")


S = TypeVar("S", bound=WorkerSettings)


def read_settings(path: str | Path, kind: type[S]) -> S:
    """The settings in `path`, validated as `kind`; ValueError naming the file and the field."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=kind)
    except (OSError, msgspec.DecodeError) as e:  # ValidationError is a DecodeError
        raise ValueError(f"worker settings {path}: {e}") from None
