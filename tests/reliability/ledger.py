"""What every fault test checks afterwards: each live worker's KV block ledger balances (all blocks
free, nothing running, nothing quarantined) and a canary request is served."""

from __future__ import annotations

import re
import time
import urllib.request

import httpx


def node_gauges(base: str, name: str) -> dict[str, float]:
    """{node: value} of a per-worker gauge from the gateway's /metrics."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=2).read().decode()
    return {
        n: float(v) for n, v in re.findall(rf'{name}\{{node="((?:prefill|decode|colocated)[^"]+)"\}} ([0-9.e+]+)', text)
    }


def wait_ledger_balanced(base: str, timeout_s: float = 5.0) -> None:
    """Wait until every worker reports all KV blocks free and nothing running; assert it."""
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = node_gauges(base, "pdserve_kv_blocks_free"), node_gauges(base, "pdserve_kv_blocks_total")
        running = node_gauges(base, "pdserve_num_requests_running")
        quarantined = node_gauges(base, "pdserve_kv_blocks_quarantined")
        ok = free and free == total and not any(running.values()) and not any(quarantined.values())
        if ok:
            return
        if time.monotonic() > deadline:
            raise AssertionError(
                f"KV ledger not balanced after {timeout_s}s: free {free}, total {total}, "
                f"running {running}, quarantined {quarantined}"
            )
        time.sleep(0.2)


def assert_canary_served(base: str, tokens: int = 3) -> None:
    """A small request succeeds with exactly `tokens` tokens."""
    r = httpx.post(
        f"{base}/v1/completions",
        timeout=60,
        json={"prompt": [5, 6, 7], "max_tokens": tokens, "min_tokens": tokens, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == tokens
