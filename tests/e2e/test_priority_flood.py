"""Priorities across the pools on real processes: a low-priority tenant floods `pdserve serve`
(1P1D, model of real shape, so each prompt's prefill takes a step of its own) and an interactive
tenant's request sent after the flood gets its first token ahead of most of it: the gateway's
admission queue and the prefill worker's scheduler both order by priority (lower first), the
decode worker preempts the least urgent first. Nothing of the flood is lost; every block comes
back."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time
import urllib.request

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import random_prompts
from tests.e2e.cluster import running_server
from tests.e2e.roles import wait_for

pytestmark = pytest.mark.slow

FLOOD = 8
PROMPT = 500  # tokens: one prefill step (512) each


def _first_token_at(base: str, key: str, prompt: list[int], model: str) -> tuple[float, str | None]:
    """When (monotonic) the stream's first token came, and its finish reason."""
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    first, finish = 0.0, None
    with httpx.stream(
        "POST", f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=300
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                first = first or time.monotonic()
                finish = choice.get("finish_reason") or finish
    return first, finish


def _gauge(base: str, name: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
    return float(re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M).group(1))


def test_an_urgent_request_overtakes_a_low_priority_flood(real_llama, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(
        json.dumps(
            {
                "keys": [
                    {"name": "batch", "key": "sk-batch", "priority": 10},
                    {"name": "interactive", "key": "sk-interactive", "priority": 0},
                ]
            }
        )
    )
    tok = AutoTokenizer.from_pretrained(real_llama)
    prompts = random_prompts(tok.vocab_size, [PROMPT] * (FLOOD + 1), seed=21)
    extra = ("--api-keys-file", str(keys), "--max-model-len", "1024", "--num-blocks", "512")
    with running_server(real_llama, *extra) as base:
        with cf.ThreadPoolExecutor(FLOOD + 1) as pool:
            flood = [pool.submit(_first_token_at, base, "sk-batch", p, real_llama.name) for p in prompts[:FLOOD]]
            # the whole flood is in (queued at the gateway or the prefill worker) before the urgent one
            wait_for(lambda: _gauge(base, "pdserve_gateway_requests_in_flight") >= FLOOD, 120, "the flood admitted")
            urgent = pool.submit(_first_token_at, base, "sk-interactive", prompts[FLOOD], real_llama.name)
            urgent_first, urgent_finish = urgent.result(timeout=300)
            flood_results = [f.result(timeout=300) for f in flood]
        assert urgent_finish == "length" and all(finish == "length" for _, finish in flood_results)
        overtaken = sum(first > urgent_first for first, _ in flood_results)
        assert overtaken >= FLOOD // 2, f"the urgent request overtook {overtaken} of {FLOOD}"
        metrics = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
        done = dict(re.findall(r'pdserve_key_requests_total\{key="([^"]+)"\} ([0-9.]+)', metrics))
        assert float(done.get("batch", 0)) == FLOOD and float(done.get("interactive", 0)) == 1, done

        def all_blocks_free() -> bool:
            text = urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()
            free = dict(re.findall(r'pdserve_kv_blocks_free\{node="([^"]+)"\} ([0-9.]+)', text))
            total = dict(re.findall(r'pdserve_kv_blocks_total\{node="([^"]+)"\} ([0-9.]+)', text))
            return bool(free) and free == total

        wait_for(all_blocks_free, 15, "every KV block back")
