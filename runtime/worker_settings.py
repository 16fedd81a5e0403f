"""What a worker process is started with: one typed, validated struct per role.

`pdserve serve` plans every child's settings (cli/topology.py) and hands each its struct as a
JSON file (`pdserve prefill --settings FILE`); `pdserve prefill|decode|colocated` started alone
builds the same struct from its flags through the same planner. A field that is missing, of
the wrong type, unknown, or out of range fails at start with a message naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, TypeVar

import msgspec

from pdserve.flag import Flag
from pdserve.tracing import OtlpEndpoint

# HMAC over KV payloads (kvtransfer/wire.py); prefill and decode workers take the same flag
KvPayloadMac = Annotated[
    Literal["auto", "on", "off"],
    Flag(
        "HMAC over every KV payload's bytes, checked before they land in KV blocks: auto = on for tcp:// links "
        "left unencrypted (PDSERVE_PLANE_ENCRYPTION=off; CURVE authenticates the encrypted ones), off for "
        "ipc:// and shared memory (same host)"
    ),
]


class WorkerSettings(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What every worker role has: where it listens, which gateways it reports to, its threads."""

    control_bind: Annotated[str, Flag("this worker's control inbox", name="--bind")] = "tcp://127.0.0.1:0"
    gateways: Annotated[  # gateway inbox addresses (at least one)
        list[str],
        Flag(
            "the gateway to join (repeatable): its worker plane, e.g. tcp://10.0.0.5:7100, or its HTTP URL, e.g. "
            "http://10.0.0.5:8000 (the worker asks it for the worker plane, proving it holds the cluster secret)",
            name="--gateway",
        ),
    ]
    host: Annotated[  # the host name peers compare to decide on shared memory
        str, Flag("host name peers use to decide on shared memory (default: this host)", name="--advertise-host")
    ]
    threads: Annotated[int | None, Flag("torch threads for this worker")] = None  # None: torch's default
    # SIGTERM drains: no new requests, those held finish; past this many seconds the rest are
    # handed off (the gateway moves them to live workers) and the worker exits
    drain_timeout_s: Annotated[
        float,
        Flag(
            "on SIGTERM take no new requests and finish those held, for at most this many seconds; then hand "
            "the rest off to live workers and exit",
            name="--drain-timeout",
        ),
    ] = 30.0
    health_bind: Annotated[
        str | None, Flag("serve /health/live and /health/ready here (probes); default: none", metavar="HOST:PORT")
    ] = None
    otlp_traces_endpoint: OtlpEndpoint = None

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
