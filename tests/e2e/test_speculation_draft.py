"""`--speculative-config '{"model": DIR, ...}'` over HTTP, colocated and 1P1D (the prefill
worker ships the draft's KV: tests/e2e/test_draft_kv_shipped.py): greedy texts equal
HF generate's, concurrently and ending mid-verification (max_tokens, a stop string), the drafts are accepted
(vLLM's counters in /metrics) and every KV block comes back. A draft with another tokenizer is
refused at start."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from pdserve.modelgen.make_model import make_model
from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server
from tests.e2e.test_speculation import MAX_NEW, MODES, _total, complete, wait_for_metric
from tests.reliability.ledger import wait_ledger_balanced

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", list(MODES))
def test_draft_model_server_matches_hf(tiny_llama, mode):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts(tok.vocab_size, [7, 30, 12], seed=11)
    want = [hf_greedy(str(tiny_llama), tuple(p), MAX_NEW) for p in prompts]
    text = [tok.decode(w, skip_special_tokens=True) for w in want]
    spec = json.dumps({"model": str(tiny_llama), "num_speculative_tokens": 4})  # the target as its own draft
    with running_server(tiny_llama, *MODES[mode], "--speculative-config", spec) as base:
        greedy = {"max_tokens": MAX_NEW, "temperature": 0}
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: complete(base, prompt=p, **greedy)["choices"][0]["text"], prompts))
        assert got == text
        for p, w in zip(prompts, want):
            for n in (3, 6):
                body = complete(base, prompt=p, max_tokens=n, temperature=0)
                assert body["choices"][0]["text"] == tok.decode(w[:n], skip_special_tokens=True)
        for p, t in zip(prompts, text):  # a stop string mid-output: cut where it starts
            stop = t[len(t) // 2 : len(t) // 2 + 3]
            if stop.strip():
                body = complete(base, prompt=p, stop=[stop], **greedy)
                assert body["choices"][0]["text"] == t[: t.index(stop)]
                assert body["choices"][0]["finish_reason"] == "stop"
        wait_ledger_balanced(base, timeout_s=10)
        metrics = wait_for_metric(base, "pdserve_spec_decode_num_accepted_tokens_total")
        drafted = _total(metrics, "pdserve_spec_decode_num_draft_tokens_total")
        accepted = _total(metrics, "pdserve_spec_decode_num_accepted_tokens_total")
        assert drafted == accepted > 0, (drafted, accepted)  # its own draft: every draft accepted


def test_a_draft_with_another_tokenizer_is_refused_at_start(tiny_llama, tmp_path):
    other = make_model(tmp_path / "other", preset="tiny", arch="llama", seed=4, vocab_size=300, quiet=True)
    spec = json.dumps({"model": str(other), "num_speculative_tokens": 4})
    for extra in ([], ["--colocated"]):
        argv = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(tiny_llama), *extra]
        bad = subprocess.run([*argv, "--speculative-config", spec], capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and "target's tokenizer" in bad.stderr, bad.stderr[-2000:]
