"""Prefix caching through the whole cluster: a shared system prompt is computed once per
prefill (or colocated) worker, later requests report it in `usage.prompt_tokens_details`,
and every answer still equals HF greedy, streamed or not."""

from __future__ import annotations

import contextlib
import time
import urllib.request
from collections.abc import Iterator

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server
from tests.e2e.conftest import tiny_llama_server
from tests.e2e.metrics_delta import settled_metrics

pytestmark = pytest.mark.slow

MAX_NEW = 8
# local prefill off in 1P1D: these turns must cross from the prefill worker (tested below)
MODES = {"1P1D": ["--local-prefill-max-tokens", "0"], "colocated": ["--colocated"]}


@pytest.fixture(scope="module")
def no_local_prefill(tiny_llama) -> Iterator[str]:
    """1P1D with local prefill off, for two tests here (neither changes it; counters as deltas)."""
    with running_server(tiny_llama, *MODES["1P1D"]) as base:
        yield base


def server(request: pytest.FixtureRequest, *flags: str) -> contextlib.AbstractContextManager[str]:
    if list(flags) == MODES["1P1D"]:
        return contextlib.nullcontext(request.getfixturevalue("no_local_prefill"))
    return tiny_llama_server(request, *flags)  # colocated: the package's (conftest.py)


@pytest.mark.parametrize("mode", list(MODES))
def test_shared_system_prompt_is_reused_and_reported(request, tiny_llama, mode):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    system = random_prompts(tok.vocab_size, [70], seed=4)[0]  # 4 full 16-token blocks + 6
    prompts = [system + tail for tail in random_prompts(tok.vocab_size, [5, 11, 3], seed=5)]
    want = [tok.decode(hf_greedy(str(tiny_llama), tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]
    with server(request, *MODES[mode]) as base:
        hits_before = prefix_hits(settled_metrics(base, "pdserve_prefix_cache_hits_total"))
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        first = client.completions.create(model=model, prompt=prompts[0], max_tokens=MAX_NEW, temperature=0)
        assert first.choices[0].text == want[0]
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        second = client.completions.create(model=model, prompt=prompts[1], max_tokens=MAX_NEW, temperature=0)
        assert second.choices[0].text == want[1]
        assert second.usage.prompt_tokens_details.cached_tokens == 64  # the system prompt's full blocks
        if mode == "1P1D":  # the decode worker held those 4 blocks too: only the prompt's last 2 of 6 crossed
            sent = [r.model_extra["pdserve_timings"]["kv_bytes"] for r in (first, second)]
            assert sent[0] > 0 and sent[1] / 2 == sent[0] / 5, sent  # (75 tokens: 5 blocks; 81: 6)
        chunks = list(
            client.completions.create(
                model=model,
                prompt=prompts[2],
                max_tokens=MAX_NEW,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want[2]
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi there"}], max_tokens=4, temperature=0
        )
        assert chat.usage.prompt_tokens_details.cached_tokens >= 0
        # heartbeats carry the counters
        assert wait_until(lambda: prefix_hits(metrics_text(base)) - hits_before >= 128, 10)


def metrics_text(base: str) -> str:
    return urllib.request.urlopen(f"{base}/metrics", timeout=5).read().decode()


def prefix_hits(text: str) -> float:
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("pdserve_prefix_cache_hits_total")
    )


def wait_until(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_conversations_return_to_the_workers_holding_their_kv(tiny_llama):
    """2P2D, four conversations with their own 70-token system prompts: their first turns spread
    over the workers; each second turn goes back to the prefill and the decode worker holding
    its prefix (the gateway learns it from heartbeats), so its prompt's cached blocks are
    neither computed nor sent again. Without KV-aware routing the second turns all go to the
    same pair (equal load): two of the four would miss."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    systems = random_prompts(tok.vocab_size, [70] * 4, seed=40)
    firsts = [s + t for s, t in zip(systems, random_prompts(tok.vocab_size, [5] * 4, seed=41))]
    # (local prefill off: each turn goes through a prefill worker, whose choice is tested too)
    with running_server(
        tiny_llama, "--prefill-workers", "2", "--decode-workers", "2", "--local-prefill-max-tokens", "0"
    ) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def turn(prompt):
            return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0)

        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(4) as pool:  # concurrent: the load spreads them over both pairs
            answers = list(pool.map(turn, firsts))
        time.sleep(1.5)  # a few heartbeats: the gateway learns who holds what
        for first, answer in zip(firsts, answers):
            second = first + tok.encode(answer.choices[0].text, add_special_tokens=False)[:4] + [7, 8]
            r = turn(second)
            assert r.choices[0].text == tok.decode(
                hf_greedy(str(tiny_llama), tuple(second), MAX_NEW), skip_special_tokens=True
            )
            assert r.usage.prompt_tokens_details.cached_tokens >= 64  # on the prefill worker holding it
            blocks = -(-len(second) // 16)
            sent = r.model_extra["pdserve_timings"]["kv_bytes"]
            first_sent = answer.model_extra["pdserve_timings"]["kv_bytes"]
            assert sent <= first_sent / 5 * (blocks - 4), (sent, first_sent)  # the decode worker held 4+


def test_the_next_turn_of_a_conversation_is_prefilled_on_the_decode_worker(request, tiny_llama):
    """1P1D: the second turn's prompt is the first turn's prompt and answer plus a few tokens;
    the decode worker holds all of it but the short rest, so it prefills that itself (no
    prefill worker, no transfer). Output equals HF greedy; with --local-prefill-max-tokens 0 the
    same turn goes through the prefill pool."""
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    first = random_prompts(tok.vocab_size, [70], seed=50)[0]
    for limit, local in (("64", True), ("0", False)):
        with server(request, "--local-prefill-max-tokens", limit) as base:
            client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
            model = client.models.list().data[0].id
            before = metric(settled_metrics(base, "pdserve_local_prefills_total"), "pdserve_local_prefills_total")
            a = client.completions.create(model=model, prompt=first, max_tokens=MAX_NEW, temperature=0)
            time.sleep(1.5)  # heartbeats tell the gateway what the decode worker holds
            second = first + tok.encode(a.choices[0].text, add_special_tokens=False) + [11, 12, 13]
            r = client.completions.create(model=model, prompt=second, max_tokens=MAX_NEW, temperature=0)
            want = tok.decode(hf_greedy(str(tiny_llama), tuple(second), MAX_NEW), skip_special_tokens=True)
            assert r.choices[0].text == want
            timings = r.model_extra["pdserve_timings"]
            assert ("kv_bytes" not in timings) == local, timings  # nothing crossed from a prefill worker
            assert wait_until(lambda: metric(base, "pdserve_local_prefills_total") - before == (1 if local else 0), 5)
            if local:
                assert r.usage.prompt_tokens_details.cached_tokens >= 64


def metric(base_or_text: str, name: str) -> float:
    """A metric's samples summed, from a server (its base URL) or a /metrics text already read."""
    text = metrics_text(base_or_text) if base_or_text.startswith("http") else base_or_text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))
