"""n, best_of and beam search over HTTP, disaggregated and colocated: one prefill per request,
beams equal to HF's, seeded choices reproducible, a group migrated exactly when its decode
worker dies, and every KV block back afterwards."""

from __future__ import annotations

import os
import signal

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import hf_beams, random_prompts
from tests.e2e.cluster import running_server
from tests.e2e.conftest import tiny_llama_server
from tests.reliability.ledger import wait_ledger_balanced
from tests.reliability.test_worker_failure import busy_decode_pid

pytestmark = pytest.mark.slow

MODES = {"1P1D": ["--max-num-batched-tokens", "24"], "colocated": ["--colocated"]}  # 1P1D: chunked prefill


def complete(base: str, **body) -> dict:
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("mode", list(MODES))
def test_groups_over_http(request, tiny_llama, mode):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = random_prompts(tok.vocab_size, [37], seed=12)[0]
    beams = hf_beams(str(tiny_llama), tuple(prompt), 12, 4, 2)
    with tiny_llama_server(request, *MODES[mode]) as base:  # colocated: shared (conftest.py)
        # beam search: width best_of, the n best return, equal to HF generate(num_beams=4)
        body = complete(base, prompt=prompt, max_tokens=12, n=2, best_of=4, use_beam_search=True, temperature=0)
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert [c["text"] for c in body["choices"]] == [tok.decode(b, skip_special_tokens=True) for b in beams]
        # n sampled choices, seeded: choice i equals an n=1 request with seed + i
        sampled = {"prompt": prompt, "max_tokens": 10, "temperature": 3.0, "top_k": 40}
        group = complete(base, **sampled, n=3, seed=21)
        alone = [complete(base, **sampled, seed=21 + i)["choices"][0]["text"] for i in range(3)]
        assert [c["text"] for c in group["choices"]] == alone
        assert group["usage"]["completion_tokens"] == 30
        # streamed: each choice's deltas by index add up to the same texts
        texts = ["", "", ""]
        with httpx.stream("POST", f"{base}/v1/completions", json={**sampled, "n": 3, "seed": 21, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in httpx.Response(200, content=line[6:]).json()["choices"]:
                        texts[c["index"]] += c["text"]
        assert texts == alone
        # a stop string in choice 1 only: that member stops at its worker, the others run on
        stop = next(
            alone[1][k : k + n]
            for n in range(2, 8)
            for k in range(1, len(alone[1]) - n + 1)
            if all(alone[1][k : k + n] not in t for t in (alone[0], alone[2]))
        )
        cut = complete(base, **sampled, n=3, seed=21, stop=[stop])["choices"]
        assert [c["finish_reason"] for c in cut] == ["length", "stop", "length"]
        assert [c["text"] for c in cut] == [alone[0], alone[1][: alone[1].index(stop)], alone[2]]
        # best_of > n: the returned one is one of best_of candidates (logprobs scored, not reported)
        best = complete(base, **sampled, n=1, best_of=3, seed=21)
        assert len(best["choices"]) == 1 and best["choices"][0]["text"] in alone
        assert best["choices"][0]["logprobs"] is None
        # refused: a streamed best_of > n, sampling knobs with beam search
        r = httpx.post(f"{base}/v1/completions", json={**sampled, "best_of": 2, "stream": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
        r = httpx.post(f"{base}/v1/completions", json={**sampled, "use_beam_search": True})
        assert r.status_code == 400
        # clients leaving mid-stream: a sampled group and a beam search; every block comes back
        long = {"prompt": prompt, "max_tokens": 300, "min_tokens": 300, "stream": True}
        for extra in ({"n": 4, "temperature": 1.0}, {"n": 2, "best_of": 4, "use_beam_search": True}):
            with httpx.stream("POST", f"{base}/v1/completions", json={**long, **extra}, timeout=60) as r:
                lines = r.iter_lines()
                if not extra.get("use_beam_search"):  # (beams come whole at the end)
                    assert sum(line.startswith("data: {") for line, _ in zip(lines, range(8))) > 0
        wait_ledger_balanced(base, timeout_s=10)


def test_group_migrates_exactly_when_its_decode_worker_dies(tiny_llama):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = random_prompts(tok.vocab_size, [9], seed=5)[0]
    n_tokens = 400
    req = {"prompt": prompt, "max_tokens": n_tokens, "min_tokens": n_tokens, "temperature": 1.0, "n": 2, "seed": 8}
    with running_server(tiny_llama, "--decode-workers", "2") as base:
        want = [c["text"] for c in complete(base, **req)["choices"]]
        texts, killed = ["", ""], []
        with httpx.stream("POST", f"{base}/v1/completions", json={**req, "stream": True}, timeout=120) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                for c in httpx.Response(200, content=line[6:]).json()["choices"]:
                    texts[c["index"]] += c["text"]
                if not killed and len(texts[0]) > 20:
                    pid = busy_decode_pid(base)
                    assert pid is not None
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        assert killed
        assert texts == want  # every choice: no duplicate or missing token across the migration
        wait_ledger_balanced(base, timeout_s=10)
