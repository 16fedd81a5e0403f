"""Prefix fetches between prefill workers through a whole 2P1D cluster: a long prompt computed on
prefill worker A, then the same history with a new tail dealt to B (round-robin), which fetches
the history's blocks from A over the KV plane instead of computing them: B's metrics count them,
the answer reports them as cached, and it still equals HF greedy (fp32)."""

from __future__ import annotations

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server
from tests.e2e.metrics_delta import settled_metrics

pytestmark = pytest.mark.slow

MAX_NEW = 8
FETCHED = "pdserve_prefix_fetch_blocks_total"


def by_node(metrics: str, name: str) -> dict[str, float]:
    return {
        line.split('node="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith(name)
    }


def test_a_prefix_computed_on_one_prefill_worker_is_fetched_by_another_equal_to_hf(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    (history,) = random_prompts(tok.vocab_size, [900], seed=31)  # 56 full blocks + 4 tokens
    second = history + [11, 12, 13]
    want = [
        tok.decode(hf_greedy(str(tiny_llama), tuple(p), MAX_NEW), skip_special_tokens=True) for p in (history, second)
    ]
    flags = [
        *("--prefill-workers", "2", "--router", "round-robin", "--local-prefill-max-tokens", "0"),
        *("--max-model-len", "1024"),
    ]
    with running_server(tiny_llama, *flags) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        first = client.completions.create(model=model, prompt=history, max_tokens=MAX_NEW, temperature=0)
        assert first.choices[0].text == want[0]
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        settled_metrics(base, "pdserve_prefix_cache_queries_total")  # A's heartbeats told the gateway what it holds

        r = client.completions.create(model=model, prompt=second, max_tokens=MAX_NEW, temperature=0)
        assert r.choices[0].text == want[1]
        assert r.usage.prompt_tokens_details.cached_tokens == 56 * 16  # every usable block, fetched
        timings = r.model_extra["pdserve_timings"]
        assert timings["prefix_fetch_s"] > 0 and timings["prefix_fetch_bytes"] > 0
        # B computed 7 tokens where A computed 900 (here ~3 ms against ~80 ms; TTFT ~10 ms against ~100)
        assert timings["prefill_compute_s"] < first.model_extra["pdserve_timings"]["prefill_compute_s"] / 2

        metrics = settled_metrics(base, FETCHED, "pdserve_prefix_export_blocks_total")
        fetched = by_node(metrics, FETCHED)
        exported = by_node(metrics, "pdserve_prefix_export_blocks_total")
        assert sorted(v for n, v in fetched.items() if n.startswith("prefill")) == [0.0, 56.0]
        assert sorted(v for n, v in exported.items() if n.startswith("prefill")) == [0.0, 56.0]
        (b,) = [n for n, v in fetched.items() if v == 56.0]
        (a,) = [n for n, v in exported.items() if v == 56.0]
        assert a != b and by_node(metrics, "pdserve_prefix_fetch_failures_total")[b] == 0
        workers = {w["id"]: w for w in httpx.get(f"{base}/v1/workers", timeout=5).json()["data"]}
        peers = workers[b]["kv"]["peers"]
        assert peers["fetched_blocks"] == 56 and peers["fetched_bytes"] == timings["prefix_fetch_bytes"]
        assert workers[a]["kv"]["peers"]["exports"] == 1
