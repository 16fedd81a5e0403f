"""Peak KV-cache use of the server under test, read from its Prometheus /metrics while a run
goes on: how much memory n > 1 (or any load) takes, compared across servers.

pdserve: `pdserve_kv_blocks_free` / `_total` of its decode and colocated workers (where the
sequences live; cached blocks count as free). vLLM: `vllm:kv_cache_usage_perc` (v1; older
builds `vllm:gpu_cache_usage_perc`). Servers without either report None.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import aiohttp

_PDSERVE = re.compile(r'^pdserve_kv_blocks_(free|total)\{node="((?:decode|colocated)[^"]*)"\} ([0-9.e+]+)$', re.M)
_VLLM = re.compile(r"^vllm:(?:kv|gpu)_cache_usage_perc\{[^}]*\} ([0-9.e+-]+)$", re.M)


def kv_usage(metrics_text: str) -> tuple[float, int | None] | None:
    """(fraction of the KV cache in use, blocks in use or None) from one /metrics page."""
    pd: dict[str, dict[str, float]] = {}
    for kind, node, value in _PDSERVE.findall(metrics_text):
        pd.setdefault(node, {})[kind] = float(value)
    total = sum(v.get("total", 0.0) for v in pd.values())
    if total > 0:
        used = sum(v.get("total", 0.0) - v.get("free", 0.0) for v in pd.values())
        return used / total, int(used)
    vllm = _VLLM.findall(metrics_text)
    if vllm:
        return max(float(v) for v in vllm), None
    return None


class KvUsagePoller:
    """`async with KvUsagePoller(base_url) as poll:` ... then `poll.peak_fraction`, `poll.peak_blocks`."""

    def __init__(self, base_url: str, interval_s: float = 0.25) -> None:
        self.url = base_url.rstrip("/") + "/metrics"
        self.interval_s = interval_s
        self.peak_fraction: float | None = None
        self.peak_blocks: int | None = None
        self._task: asyncio.Task | None = None

    async def __aenter__(self) -> KvUsagePoller:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                    async with session.get(self.url) as resp:
                        got = kv_usage(await resp.text()) if resp.status == 200 else None
                    if got is not None:
                        fraction, blocks = got
                        self.peak_fraction = max(self.peak_fraction or 0.0, fraction)
                        if blocks is not None:
                            self.peak_blocks = max(self.peak_blocks or 0, blocks)
                await asyncio.sleep(self.interval_s)
