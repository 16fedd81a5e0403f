"""Rate sweeps: capacity = the highest request rate at which >= 90% of requests meet the SLOs."""

from __future__ import annotations


def capacity(points: list[tuple[float, float]], attainment: float = 0.9) -> float | None:
    """points: (request rate, SLO attainment). Highest rate whose attainment >= the target and
    at every lower rate too (a lucky point above a failing one does not count)."""
    best = None
    for rate, att in sorted(points):
        if att < attainment:
            break
        best = rate
    return best
