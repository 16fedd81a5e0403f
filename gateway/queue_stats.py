"""How much waits in one pool's queue (a plain value, read by /metrics)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class QueueStats:
    depth: int  # requests waiting
    tokens: int  # their prompt tokens
