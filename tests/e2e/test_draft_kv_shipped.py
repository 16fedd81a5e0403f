"""A draft model's KV built by the prefill pool and shipped with the target's,
over HTTP with real processes: `serve --speculative-config '{"model": DRAFT, ...}'` gives the
draft to the prefill worker too. Greedy text equals HF's (so the output without speculation),
with chunked prefill and a repeated prompt that hits both prefix caches; the decode worker
never rebuilt the draft's KV (`pdserve_spec_draft_prefill_tokens_total{source=...}`: shipped,
none rebuilt); a killed decode worker's request migrates exactly and every block comes back.
A prefill worker started without the draft ships none: the decode worker rebuilds it."""

from __future__ import annotations

import concurrent.futures as cf
import json
import re
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import free_port, running_server
from tests.e2e.roles import processes, wait_for, workers
from tests.e2e.test_speculation import complete
from tests.engine.test_speculation_draft import noisy_copy
from tests.reliability.ledger import wait_ledger_balanced
from tests.reliability.test_worker_failure import N, stream_killing_decode

pytestmark = pytest.mark.slow

MAX_NEW = 40
METRIC = "pdserve_spec_draft_prefill_tokens_total"


def draft_kv_tokens(base: str) -> dict[str, float]:
    """Prompt tokens of the decode pool's draft KV by source, summed over decode workers."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    out = {"shipped": 0.0, "cached": 0.0, "rebuilt": 0.0}
    for source, value in re.findall(rf'{METRIC}\{{node="decode[^"]*",source="(\w+)"\}} ([0-9.e+]+)', text):
        out[source] += float(value)
    return out


def settled_counts(base: str, done, timeout_s: float = 10.0) -> dict[str, float]:
    """The counters once `done(counts)` holds (they come with heartbeats), else the last seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        counts = draft_kv_tokens(base)
        if done(counts) or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def greedy_texts(base: str, prompts: list[list[int]]) -> list[str]:
    body = {"max_tokens": MAX_NEW, "temperature": 0}
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(base, prompt=p, **body)["choices"][0]["text"], prompts))


@pytest.fixture(scope="module")
def draft(tiny_llama, tmp_path_factory):
    """A draft that agrees with the target often, not always (some drafts rejected)."""
    return noisy_copy(tiny_llama, tmp_path_factory.mktemp("drafts") / "noisy-tiny-llama", 0.5)


def test_prefill_pool_ships_the_draft_kv(tiny_llama, draft):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts(tok.vocab_size, [7, 30, 52], seed=11)
    want = [tok.decode(hf_greedy(str(tiny_llama), tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]
    spec = json.dumps({"model": str(draft), "num_speculative_tokens": 4})
    extra = ["--max-num-batched-tokens", "24", "--local-prefill-max-tokens", "0", "--decode-workers", "2"]
    with running_server(tiny_llama, *extra, "--speculative-config", spec) as base:
        assert greedy_texts(base, prompts) == want  # chunked prefill (24 tokens a step), concurrent
        prompt_tokens = sum(map(len, prompts))
        counts = settled_counts(base, lambda c: c["shipped"] + c["cached"] >= prompt_tokens)
        assert counts["rebuilt"] == 0 and counts["shipped"] + counts["cached"] == prompt_tokens, counts
        hits = _total(base, "pdserve_prefix_cache_hits_total", "prefill")
        assert greedy_texts(base, [prompts[2]]) == [want[2]]  # again: P computes its last block only
        deadline = time.monotonic() + 10  # (worker counters come with heartbeats)
        while _total(base, "pdserve_prefix_cache_hits_total", "prefill") < hits + 48 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _total(base, "pdserve_prefix_cache_hits_total", "prefill") >= hits + 48
        counts = settled_counts(base, lambda c: c["shipped"] + c["cached"] >= prompt_tokens + 52)
        assert counts["rebuilt"] == 0 and counts["shipped"] + counts["cached"] == prompt_tokens + 52, counts
        accepted = _total(base, "pdserve_spec_decode_num_accepted_tokens_total", "decode")
        drafted = _total(base, "pdserve_spec_decode_num_draft_tokens_total", "decode")
        assert 0 < accepted < drafted, (accepted, drafted)
        wait_ledger_balanced(base, timeout_s=10)
        # SIGKILL of the decode worker mid-stream: the request migrates, the text stays exact
        prompt = random_prompts(tok.vocab_size, [9], seed=5)[0]
        long_want = tok.decode(hf_greedy(str(tiny_llama), tuple(prompt), N, N), skip_special_tokens=True)
        killed: list[int] = []
        text, finish = stream_killing_decode(base, prompt, killed)
        assert killed and finish == "length" and text == long_want
        wait_ledger_balanced(base, timeout_s=15)


def _total(base: str, name: str, role: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(rf'{name}\{{node="{role}[^"]*"\}} ([0-9.e+]+)', text))


def test_a_prefill_worker_without_the_draft_leaves_it_to_the_decode_worker(tiny_llama, draft, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts(tok.vocab_size, [7, 30], seed=12)
    want = [tok.decode(hf_greedy(str(tiny_llama), tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]
    spec = json.dumps({"model": str(draft), "num_speculative_tokens": 4})
    port, wport = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    common = ["--model", str(tiny_llama), "--dtype", "float32", "--num-blocks", "256", "--max-model-len", "512"]
    with processes(tmp_path) as procs:
        gateway = ["--model", str(tiny_llama), "--port", str(port), "--worker-bind", f"tcp://127.0.0.1:{wport}"]
        procs.pdserve("gateway", "gateway", *gateway)
        procs.pdserve("prefill", "prefill", *common, "--gateway", base)  # no draft here
        procs.pdserve("decode", "decode", *common, "--gateway", base, "--speculative-config", spec)
        wait_for(lambda: len(workers(base)) == 2 and all(w["state"] == "ready" for w in workers(base)), 180, "2", procs)
        assert greedy_texts(base, prompts) == want
        counts = settled_counts(base, lambda c: c["rebuilt"] >= sum(map(len, prompts)))
        assert counts["shipped"] == 0 and counts["rebuilt"] == sum(map(len, prompts)), counts
        wait_ledger_balanced(base, timeout_s=10)
