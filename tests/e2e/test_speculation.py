"""`--speculative-config` over HTTP, disaggregated (1P1D: the decode worker speculates) and
colocated, on two families: greedy texts equal HF generate's, also for requests that end
mid-verification (max_tokens, a stop string, concurrent ones), and every KV block comes back,
also after a killed decode worker and clients gone mid-stream. A bad config is refused at start."""

from __future__ import annotations

import concurrent.futures as cf
import json
import subprocess
import sys

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server
from tests.reliability.ledger import wait_ledger_balanced
from tests.reliability.test_worker_failure import N, stream_killing_decode

pytestmark = pytest.mark.slow

# measure_payoff off: every step speculates (on a loaded machine the measured choice may decide a
# batch-1 step does not pay, and the streamed check below would see no multi-token event)
SPEC = json.dumps(
    {
        "method": "ngram",
        "num_speculative_tokens": 4,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
        "measure_payoff": False,
    }
)
MODES = {"1P1D": ["--max-num-batched-tokens", "24"], "colocated": ["--colocated"]}
MAX_NEW = 40


def complete(base: str, **body) -> dict:
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_qwen2"])
@pytest.mark.parametrize("mode", list(MODES))
def test_speculating_server_matches_hf(request, family, mode):
    model = request.getfixturevalue(family)
    tok = AutoTokenizer.from_pretrained(model)
    phrase = random_prompts(tok.vocab_size, [6], seed=8)[0]
    prompts = random_prompts(tok.vocab_size, [7, 30], seed=11) + [phrase * 3, phrase + [5, 9] + phrase]
    want = [hf_greedy(str(model), tuple(p), MAX_NEW) for p in prompts]
    text = [tok.decode(w, skip_special_tokens=True) for w in want]
    with running_server(model, *MODES[mode], "--speculative-config", SPEC) as base:
        greedy = {"max_tokens": MAX_NEW, "temperature": 0}
        with cf.ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: a batch that speculates
            got = list(pool.map(lambda p: complete(base, prompt=p, **greedy)["choices"][0]["text"], prompts))
        assert got == text
        for p, w in zip(prompts, want):  # one at a time: ends inside a run of accepted drafts
            for n in (3, 6, 11):
                body = complete(base, prompt=p, max_tokens=n, temperature=0)
                assert body["choices"][0]["text"] == tok.decode(w[:n], skip_special_tokens=True)
        for p, t in zip(prompts, text):  # a stop string mid-output: cut where it starts
            stop = t[len(t) // 2 : len(t) // 2 + 3]
            if not stop.strip():
                continue
            body = complete(base, prompt=p, stop=[stop], **greedy)
            assert body["choices"][0]["text"] == t[: t.index(stop)]
            assert body["choices"][0]["finish_reason"] == "stop"
        # streamed with logprobs: a step that accepted drafts sends several tokens in one event
        # (without speculation every decode step's event carries one), and the text is HF's
        sizes, streamed = tokens_per_event(base, prompts[2], MAX_NEW)
        assert streamed == text[2]
        assert max(sizes) > 1, sizes
        wait_ledger_balanced(base, timeout_s=10)
        # vLLM's counters in the gateway's /metrics (from the workers' heartbeats, so polled)
        metrics = wait_for_metric(base, "pdserve_spec_decode_num_accepted_tokens_total")
        drafted = _total(metrics, "pdserve_spec_decode_num_draft_tokens_total")
        accepted = _total(metrics, "pdserve_spec_decode_num_accepted_tokens_total")
        first = _total(metrics, 'pdserve_spec_decode_num_accepted_tokens_per_pos_total{node="', 'position="0"}')
        assert drafted >= accepted >= first > 0, (drafted, accepted, first)


def _total(metrics: str, prefix: str, suffix: str = "") -> float:
    """The sum over nodes of a metric's samples whose line starts with `prefix` (and has `suffix`)."""
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(prefix) and suffix in line
    )


def wait_for_metric(base: str, name: str, timeout_s: float = 5.0) -> str:
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"{base}/metrics", timeout=5).text
        if _total(text, name) > 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.2)


def tokens_per_event(base: str, prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 1, "stream": True}
    sizes, text = [], ""
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    text += c["text"]
                    if c.get("logprobs"):
                        sizes.append(len(c["logprobs"]["tokens"]))
    return sizes, text


def test_decode_worker_killed_and_clients_gone_during_speculation(tiny_llama):
    """SIGKILL of the speculating decode worker mid-stream: the request migrates and the text is
    exact; clients leaving mid-stream; afterwards every block is back on the live workers."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = random_prompts(tok.vocab_size, [9], seed=5)[0]
    want = tok.decode(hf_greedy(str(tiny_llama), tuple(prompt), N, N), skip_special_tokens=True)
    with running_server(tiny_llama, "--decode-workers", "2", "--speculative-config", SPEC) as base:
        killed: list[int] = []
        text, finish = stream_killing_decode(base, prompt, killed)
        assert killed and finish == "length"
        assert text == want  # no duplicate or missing tokens across the migration
        long = {"prompt": prompt, "max_tokens": 300, "min_tokens": 300, "temperature": 0, "stream": True}
        for _ in range(3):
            with httpx.stream("POST", f"{base}/v1/completions", json=long, timeout=60) as r:
                lines = r.iter_lines()
                assert sum(line.startswith("data: {") for line, _ in zip(lines, range(6))) > 0
        wait_ledger_balanced(base, timeout_s=10)


def test_bad_speculative_config_is_refused_at_start(tiny_llama):
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(tiny_llama)]
    bad = subprocess.run([*argv, "--speculative-config", '{"method": "ngram"}'], capture_output=True, text=True)
    assert bad.returncode == 2 and "needs num_speculative_tokens" in bad.stderr
