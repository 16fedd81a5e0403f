"""A client that goes away (streaming or not) aborts its request on every worker: all KV blocks
come back and nothing keeps running, long before the request could have finished by itself.

Uses the ~30M model: 450 tokens take ~8 s to generate there, and everything must be idle within
3 s of the hang-up (heartbeats carry the gauges every 0.5 s)."""

from __future__ import annotations

import re
import time
import urllib.request

import httpx
import pytest

from tests.e2e.cluster import running_server
from tests.reliability.faults import stall_env

pytestmark = pytest.mark.slow

LONG = {"prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 450, "min_tokens": 450, "temperature": 0}


def node_gauges(base: str, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=2).read().decode()
    return {n: float(v) for n, v in re.findall(rf'{name}\{{node="((?:prefill|decode)[^"]+)"\}} ([0-9.e+]+)', text)}


def wait_all_idle(base: str, timeout_s: float = 3.0) -> tuple[dict, dict, dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        free, total = node_gauges(base, "pdserve_kv_blocks_free"), node_gauges(base, "pdserve_kv_blocks_total")
        running = node_gauges(base, "pdserve_num_requests_running")
        if (free and free == total and not any(running.values())) or time.monotonic() > deadline:
            return free, total, running
        time.sleep(0.2)


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    from pdserve.modelgen.make_model import make_model

    return make_model(tmp_path_factory.mktemp("bench") / "bench", preset="bench", quiet=True)


def test_disconnects_free_every_block(bench_model):
    with running_server(bench_model) as base:
        with httpx.Client(base_url=base, timeout=30) as client:
            # streaming: read a few chunks, then hang up
            with client.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
                lines = r.iter_lines()
                got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            free, total, running = wait_all_idle(base)
            assert free == total and not any(running.values()), (free, total, running)

            # non-streaming: the client times out and goes away mid-generation
            with pytest.raises(httpx.TimeoutException):
                client.post("/v1/completions", json=LONG, timeout=0.4)
            free, total, running = wait_all_idle(base)
            assert free == total and not any(running.values()), (free, total, running)

            # and the server still serves
            r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_disconnect_while_a_lane_computes_the_prompt(bench_model):
    """The Abort reaches the prefill worker while a lane is writing the prompt's KV blocks: the
    worker aborts once the lane is done with them, and the decode worker's lease comes back."""
    prompt = list(range(5, 305))  # one 300-token chunk
    with running_server(bench_model, env=stall_env("prefill", 3)) as base:
        with httpx.Client(base_url=base, timeout=30) as client:
            with pytest.raises(httpx.TimeoutException):  # gone while the lane is stuck in layer 0
                client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 5}, timeout=0.5)
            free, total, running = wait_all_idle(base, timeout_s=10)
            assert free == total and not any(running.values()), (free, total, running)
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            free, total, running = wait_all_idle(base)
            assert free == total and not any(running.values()), (free, total, running)
