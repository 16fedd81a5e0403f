"""Decode step pacing: spend a TPOT target's slack on prefill while prompts wait for the cores.

On a machine shared by both pools, a decode worker that steps back to back at batch 1-3 keeps
its core busy reading the whole model's weights for one to three tokens a step, while prefill
(a prefill worker's idle lane, prefill_node/lanes.py, or a second prefill worker) waits for
that core. While prompts for this worker queue behind a prefill (n KV leases active: one
prompt prefilling, n - 1 waiting), the pacer starts decode steps no closer than
`max_interval_ms * min(n - 1, RAMP_QUEUED) / RAMP_QUEUED`. The gaps go to prefill, and the
decode batch grows: each running request stays longer, so more of them share every pass over
the weights (bench-engine, two threads, 2026-11-23: 6.9 ms a step at batch 1, 11.0 at batch 8), and
decode's CPU per request falls.

A lone prefill does not slow decode at all (nothing queues behind it, so TTFT is its compute);
a backlog, which is what puts TTFT at risk, gets the most. No token waits longer than
`max_interval_ms` for its step, and only while prompts are queued for the cores.
"""

from __future__ import annotations

import math
import time

RAMP_QUEUED = 2  # prompts queued behind a prefill at which the interval reaches its maximum


class StepPacer:
    def __init__(self, max_interval_ms: float = 0.0) -> None:
        if not max_interval_ms >= 0:
            raise ValueError(f"decode step interval must be >= 0 ms (got {max_interval_ms})")
        self.max_interval_s = max_interval_ms / 1000.0
        self._last_start = -math.inf

    @property
    def enabled(self) -> bool:
        return self.max_interval_s > 0

    def interval_s(self, prefills_in_flight: int) -> float:
        """Least time between step starts with this many prefills in flight (one computing,
        the rest queued)."""
        queued = max(0, prefills_in_flight - 1)
        return self.max_interval_s * min(queued, RAMP_QUEUED) / RAMP_QUEUED

    def delay_ms(self, prefills_in_flight: int, now: float | None = None) -> int:
        """Whole milliseconds until the next step may start (0: now). Rounded up, so a caller
        that sleeps this long never spins on a sub-millisecond remainder."""
        if not self.enabled or prefills_in_flight <= 1:
            return 0
        now = time.monotonic() if now is None else now
        remaining = self._last_start + self.interval_s(prefills_in_flight) - now
        return math.ceil(remaining * 1000.0) if remaining > 0 else 0

    def started(self, now: float | None = None) -> None:
        """A step starts now."""
        self._last_start = time.monotonic() if now is None else now
