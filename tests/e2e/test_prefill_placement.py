"""Prefill placement through a real `pdserve serve` 1P1D (tiny model, loopback): under `auto` a short
uncached prompt on an idle cluster is prefilled by the decode worker itself (no transfer: the
cost model's local cost is its compute, the pool's is the same compute plus the KV transfer);
`remote` sends every prompt through the prefill pool, `local` none; `serve` without the flag
behaves as `auto`; greedy output equals HF transformers in each placement, streamed or not."""

from __future__ import annotations

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server
from tests.e2e.test_prefix_reuse import metric, wait_until

pytestmark = pytest.mark.slow

MAX_NEW = 12
LENGTHS = [30, 200, 9]  # short, over the auto cap (128), short


@pytest.mark.parametrize("placement", ["auto", "remote", "local", "default"])
def test_placement_keeps_greedy_output_and_decides_where_prompts_are_prefilled(tiny_llama, placement):
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = random_prompts(tok.vocab_size, LENGTHS, seed=32)
    want = [tok.decode(hf_greedy(str(tiny_llama), tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]
    flags = () if placement == "default" else ("--prefill-placement", placement)
    placement = "auto" if placement == "default" else placement  # serve's default
    with running_server(tiny_llama, *flags, default_placement=not flags) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        local_count = lambda: metric(base, "pdserve_local_prefills_total")  # noqa: E731
        got, crossed = [], []
        for i, p in enumerate(prompts):
            r = client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0)
            got.append(r.choices[0].text)
            crossed.append("kv_bytes" in r.model_extra["pdserve_timings"])  # a prefill worker sent its KV
            if i == 0 and placement == "auto":  # the first, short and uncached, on an idle cluster
                assert wait_until(lambda: local_count() == 1, 5), local_count()
                assert not crossed[0]
        if placement == "remote":  # every uncached prompt through the pool
            assert crossed == [True] * 3
            assert wait_until(lambda: local_count() == 0, 3)
        # the same prompts again, streamed (now cached on the decode worker: under remote, its
        # short held rest may be prefilled there, the rule before `auto`)
        streamed = [
            "".join(
                c.choices[0].text
                for c in client.completions.create(
                    model=model, prompt=p, max_tokens=MAX_NEW, temperature=0, stream=True
                )
                if c.choices
            )
            for p in prompts
        ]
        assert got == want and streamed == want
        if placement == "local":
            assert crossed == [False] * 3
            assert wait_until(lambda: local_count() == 6, 5), local_count()  # every prompt, streamed or not
        else:
            assert crossed[1]  # 200 tokens: over the cap, through the pool
