"""`--speculative-config '{"method": "eagle", "model": DIR, ...}'` over HTTP, colocated and 1P1D
(the decode worker has no hidden states of the prompt: its head's context starts at the first
decoded position), on Llama and Qwen2: greedy texts equal HF generate's, concurrently and
ending mid-verification (max_tokens, a stop string), drafts are accepted (vLLM's counters in
/metrics), and every KV block comes back, also after clients leave mid-stream."""

from __future__ import annotations

import concurrent.futures as cf
import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server
from tests.e2e.test_speculation import MAX_NEW, MODES, _total, complete, wait_for_metric
from tests.engine.eagle_fixtures import echo_head
from tests.reliability.ledger import wait_ledger_balanced

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_eagle_server_matches_hf(request, tmp_path_factory, family, mode):
    model = request.getfixturevalue(family)
    head = echo_head(model, tmp_path_factory.mktemp("heads") / "echo", 0.5)
    tok = AutoTokenizer.from_pretrained(model)
    prompts = random_prompts(tok.vocab_size, [7, 30, 12], seed=11)
    want = [hf_greedy(str(model), tuple(p), MAX_NEW) for p in prompts]
    text = [tok.decode(w, skip_special_tokens=True) for w in want]
    spec = json.dumps({"method": "eagle", "model": str(head), "num_speculative_tokens": 4})
    with running_server(model, *MODES[mode], "--speculative-config", spec) as base:
        greedy = {"max_tokens": MAX_NEW, "temperature": 0}
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(lambda p: complete(base, prompt=p, **greedy)["choices"][0]["text"], prompts))
        assert got == text
        for p, w in zip(prompts, want):
            for n in (3, 6):
                body = complete(base, prompt=p, max_tokens=n, temperature=0)
                assert body["choices"][0]["text"] == tok.decode(w[:n], skip_special_tokens=True)
        stops = 0
        for p, t in zip(prompts, text):  # a stop string mid-output: cut where it starts
            stop = t[len(t) // 2 : len(t) // 2 + 3]
            if stop.strip():
                stops += 1
                body = complete(base, prompt=p, stop=[stop], **greedy)
                assert body["choices"][0]["text"] == t[: t.index(stop)]
                assert body["choices"][0]["finish_reason"] == "stop"
        assert stops > 0
        long = {"prompt": prompts[0], "max_tokens": 200, "min_tokens": 200, "temperature": 0, "stream": True}
        for _ in range(2):  # clients gone mid-stream
            with httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=60) as r:
                lines = r.iter_lines()
                assert sum(line.startswith("data: {") for line, _ in zip(lines, range(6))) > 0
        wait_ledger_balanced(base, timeout_s=30)  # (generous: the shared test host is often loaded)
        metrics = wait_for_metric(base, "pdserve_spec_decode_num_accepted_tokens_total", timeout_s=15)
        drafted = _total(metrics, "pdserve_spec_decode_num_draft_tokens_total")
        accepted = _total(metrics, "pdserve_spec_decode_num_accepted_tokens_total")
        assert 0 < accepted < drafted, (drafted, accepted)
