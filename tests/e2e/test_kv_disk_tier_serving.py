"""The prefix cache's disk tier through a whole 1P1D cluster on a tiny RAM pool (16 blocks, where
three 120-token conversations take 24): returning prompts whose blocks left RAM are read back from
disk, and after a restart of every process too, and every answer still equals HF greedy (fp32,
KV stored as computed). The metrics and GET /v1/workers show the tier."""

from __future__ import annotations

import time

import httpx
import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server
from tests.e2e.metrics_delta import samples, settled_metrics

pytestmark = pytest.mark.slow

MAX_NEW = 8
HITS = "pdserve_kv_disk_hits_total"


def test_returning_prompts_come_back_from_disk_equal_to_hf_and_after_a_restart(tiny_llama, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts(tok.vocab_size, [120, 121, 122], seed=12)
    want = [tok.decode(hf_greedy(str(tiny_llama), tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]
    flags = [
        *("--num-blocks", "16", "--max-model-len", "256", "--local-prefill-max-tokens", "0"),
        *("--kv-offload-dir", str(tmp_path / "kv"), "--kv-offload-size", "64MiB"),
    ]

    def rounds(base: str, n: int) -> None:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        for _ in range(n):
            for p, w in zip(prompts, want):  # one at a time: each evicts the one before last
                r = client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0)
                assert r.choices[0].text == w

    with running_server(tiny_llama, *flags) as base:
        rounds(base, 2)
        hits = sum(samples(settled_metrics(base, HITS), HITS))
        assert hits >= 3 * 6 * 16  # the second round's prompts: their evicted full blocks, from disk
        workers = httpx.get(f"{base}/v1/workers", timeout=5).json()["data"]
        disk = {w["role"]: w["kv"]["disk"] for w in workers}
        assert disk["prefill"]["blocks"] >= 3 * 7 and disk["prefill"]["capacity_bytes"] == 64 * 2**20
        assert disk["prefill"]["corrupt"] == 0 and disk["prefill"]["hit_tokens"] > 0
    with running_server(tiny_llama, *flags) as base:  # every process restarted: the files stay
        rounds(base, 1)
        assert sum(samples(settled_metrics(base, HITS), HITS)) >= 3 * 6 * 16


def test_a_prefix_computed_on_one_prefill_worker_is_read_by_another(tiny_llama, tmp_path):
    """2P1D sharing one disk folder, requests dealt round-robin: a 120-token prompt computed on
    prefill worker A; the same prompt with a new tail then goes to B, which reads the prefix's
    blocks A wrote (its own RAM never held them) and computes only the tail, equal to HF."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    (history,) = random_prompts(tok.vocab_size, [120], seed=13)
    second = history + [11, 12, 13]
    want = tok.decode(hf_greedy(str(tiny_llama), tuple(second), MAX_NEW), skip_special_tokens=True)
    flags = [
        *("--prefill-workers", "2", "--router", "round-robin", "--local-prefill-max-tokens", "0"),
        *("--kv-offload-dir", str(tmp_path / "kv"), "--max-model-len", "256"),
    ]
    with running_server(tiny_llama, *flags) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        client.completions.create(model=model, prompt=history, max_tokens=MAX_NEW, temperature=0)
        deadline = time.monotonic() + 30  # A's writer thread finishes the history's 7 files
        while len(list((tmp_path / "kv").glob("*/*.kvb"))) < 7:
            assert time.monotonic() < deadline, "the prefill worker wrote no block files"
            time.sleep(0.1)
        r = client.completions.create(model=model, prompt=second, max_tokens=MAX_NEW, temperature=0)
        assert r.choices[0].text == want
        assert r.usage.prompt_tokens_details.cached_tokens == 112  # the history's 7 full blocks
        text = settled_metrics(base, HITS)
        by_node = {
            line.split('node="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(HITS)
        }
        prefill_hits = [v for node, v in by_node.items() if node.startswith("prefill")]
        assert sorted(prefill_hits) == [0.0, 112.0]
