"""Real processes on loopback, the official `openai` client, greedy output == HF generate."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.conftest import tiny_llama_server

pytestmark = pytest.mark.slow

MAX_NEW = 16
LENGTHS = [7, 30, 65, 12]

MODES = {
    "1P1D-shm": ["--prefill-workers", "1", "--decode-workers", "1", "--kv-transport", "shm"],
    "1P1D-zmq-ipc": ["--kv-transport", "zmq-ipc"],
    "1P1D-zmq-tcp": ["--kv-transport", "zmq-tcp", "--max-num-batched-tokens", "24"],  # chunked
    "2P2D": ["--prefill-workers", "2", "--decode-workers", "2"],
    "colocated": ["--colocated"],
}


def expected_texts(model, tok, prompts):
    return [tok.decode(hf_greedy(str(model), tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_through_http_matches_hf(request, tiny_llama, mode):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts(tok.vocab_size, LENGTHS, seed=11)
    want = expected_texts(tiny_llama, tok, prompts)
    with tiny_llama_server(request, *MODES[mode]) as base:  # colocated: shared (conftest.py)
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def complete(p):
            r = client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0)
            return r.choices[0].text

        def stream(p):
            chunks = client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with cf.ThreadPoolExecutor(len(prompts)) as pool:  # concurrent requests
            got = list(pool.map(complete, prompts))
            got_stream = list(pool.map(stream, prompts))
    assert got == want
    assert got_stream == want
