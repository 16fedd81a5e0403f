"""Counters of a server other tests share, read as their growth over a test's own requests."""

from __future__ import annotations

import time

import httpx


def samples(metrics: str, prefix: str) -> list[float]:
    """The values of a metric's samples whose line starts with `prefix`."""
    return [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix)]


def settled_metrics(base: str, *prefixes: str) -> str:
    """/metrics once the samples starting with `prefixes` stop growing for longer than two
    heartbeats (the workers send their counters every 0.5 s): what earlier requests counted is in,
    so a difference from this text counts later requests only."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    deadline = time.monotonic() + 30
    while True:
        time.sleep(1.2)
        later = httpx.get(f"{base}/metrics", timeout=5).text
        if all(samples(later, p) == samples(text, p) for p in prefixes):
            return later
        assert time.monotonic() < deadline, f"{prefixes} still growing on an idle server"
        text = later


def delta(before: str, after: str, prefix: str) -> float:
    """How much the samples starting with `prefix` grew from one /metrics text to a later one."""
    return sum(samples(after, prefix)) - sum(samples(before, prefix))
