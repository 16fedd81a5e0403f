"""Soak: 240 requests, ~25% abandoned by their clients at random, a busy decode worker SIGKILLed
midway. No request hangs, the rest finish, no KV block leaks, worker memory stays flat.

The ledger must balance within 5 s (heartbeat lag), far inside the 30 s lease deadline: aborted
leases come back through KvRelease / KvDone / unused-lease aborts, not by waiting out quarantine."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest

from tests.e2e.cluster import running_server
from tests.reliability.procs import rss_mib, worker_pids
from tests.reliability.test_client_disconnect import node_gauges, wait_all_idle
from tests.reliability.test_worker_failure import busy_decode_pid

pytestmark = pytest.mark.slow

N, CONCURRENCY = 240, 16


async def soak(base: str, kill_at: int | None, seed: int = 0) -> tuple[dict[str, int], int | None]:
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    killed: list[int] = []
    sem = asyncio.Semaphore(CONCURRENCY)
    started = 0

    async def one(i: int, client: httpx.AsyncClient):
        nonlocal started
        async with sem:
            started += 1
            if started == kill_at and not killed:
                pid = await asyncio.to_thread(busy_decode_pid, base)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            body = {
                "prompt": [rng.randrange(3, 400) for _ in range(rng.randint(4, 60))],
                "max_tokens": rng.randint(4, 60),
                "stream": rng.random() < 0.5,
            }
            abandon = rng.random() < 0.25
            try:
                coro = client.post("/v1/completions", json=body)
                r = await (asyncio.wait_for(coro, rng.uniform(0.01, 0.3)) if abandon else coro)
                key = f"http {r.status_code}"
                if r.status_code == 200 and not body["stream"]:
                    key = f"finish {r.json()['choices'][0]['finish_reason']}"
                elif r.status_code == 200 and "[DONE]" not in r.text:
                    key = "stream without [DONE]"
            except asyncio.TimeoutError:
                key = "abandoned"
            outcomes[key] = outcomes.get(key, 0) + 1

    async with httpx.AsyncClient(base_url=base, timeout=60) as client:
        await asyncio.wait_for(asyncio.gather(*[one(i, client) for i in range(N)]), timeout=300)
    return outcomes, (killed[0] if killed else None)


def test_soak_with_aborts_and_a_killed_worker(tiny_llama):
    with running_server(tiny_llama, "--decode-workers", "2") as base:
        # Warm-up: one soak round without the kill. The workers' allocators reach the high-water
        # mark of this load (a lane's malloc arena grows ~55 MiB, once, and keeps it: the heap
        # is tuned not to trim, kvtransfer/malloc_tuning.py), so growth after it is what leaks.
        warm_outcomes, _ = asyncio.run(soak(base, kill_at=None, seed=1))
        assert sum(warm_outcomes.values()) == N, warm_outcomes
        before = {node: rss_mib(pid) for node, pid in worker_pids(base).items()}
        t0 = time.monotonic()
        outcomes, killed = asyncio.run(soak(base, kill_at=N // 2))
        assert killed is not None
        assert sum(outcomes.values()) == N  # nobody hung (the whole soak is bounded too)
        ok = sum(v for k, v in outcomes.items() if k in ("finish length", "finish stop", "http 200"))
        assert ok + outcomes.get("abandoned", 0) == N, outcomes  # the kill cost no request
        free, total, running = wait_all_idle(base, timeout_s=5)  # heartbeat lag only
        leases = (node_gauges(base, "pdserve_kv_leases_active"), node_gauges(base, "pdserve_kv_blocks_quarantined"))
        assert free == total and not any(running.values()), (free, total, running, leases)
        after = {node: rss_mib(pid) for node, pid in worker_pids(base).items() if node in before}
        for node, mib in after.items():
            assert mib < before[node] + 32, f"{node} grew from {before[node]:.0f} to {mib:.0f} MiB"
        print(f"soak: {outcomes} in {time.monotonic() - t0:.1f}s; RSS before {before} after {after}")
