"""A prompt whose last token chunking leaves for a step of its own is served exactly under 1P1D.

Serve's prefill budget is 512 tokens: a 513-token prompt on a prefill worker with one lane is
prefilled as 512 tokens, then the last token alone, in a block of its own; with two lanes free a
129-token prompt is split 128 + 1 (prefill_node/lane_split.py). The scheduler once called such a
1-token chunk a decode, so its KV was never sent: the decode worker refused the transfer
(incomplete, HTTP 500), or, when the token shared a block sent earlier, decoded from a stale KV.
"""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("length", "flags"),
    [(513, ["--prefill-idle-lanes", "0"]), (129, ["--prefill-idle-lanes", "1"])],
    ids=["512+1-one-lane", "128+1-two-lanes"],
)
def test_a_prompts_last_token_alone_in_a_chunk(tiny_llama, length, flags):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = random_prompts(tok.vocab_size, [length], seed=3)[0]
    want = tok.decode(hf_greedy(str(tiny_llama), tuple(prompt), 8), skip_special_tokens=True)
    with running_server(tiny_llama, *flags, "--max-model-len", "1024") as base:
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want
