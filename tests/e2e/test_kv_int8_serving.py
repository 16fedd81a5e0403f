"""`serve --kv-cache-dtype int8`: a prefill worker's int8 blocks reach the decode worker as stored
(values and scales, over shared memory and over ZeroMQ with chunked prefill), so 1P1D gives the
tokens of a colocated int8 server."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import random_prompts
from tests.e2e.cluster import running_server

pytestmark = pytest.mark.slow

MAX_NEW = 24
LENGTHS = [7, 30, 65, 12]
INT8 = ["--kv-cache-dtype", "int8"]


def greedy_texts(model, prompts: list[list[int]], *flags: str) -> list[str]:
    with running_server(model, *INT8, *flags) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        name = client.models.list().data[0].id

        def complete(p: list[int]) -> str:
            return client.completions.create(model=name, prompt=p, max_tokens=MAX_NEW, temperature=0).choices[0].text

        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(complete, prompts))


def test_1p1d_int8_gives_the_colocated_int8_tokens(tiny_llama):
    prompts = random_prompts(AutoTokenizer.from_pretrained(tiny_llama).vocab_size, LENGTHS, seed=21)
    want = greedy_texts(tiny_llama, prompts, "--colocated")
    assert greedy_texts(tiny_llama, prompts, "--kv-transport", "shm") == want
    assert greedy_texts(tiny_llama, prompts, "--kv-transport", "zmq-tcp", "--max-num-batched-tokens", "24") == want
