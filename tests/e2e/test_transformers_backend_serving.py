"""Families served through transformers' modelling code (GPT-NeoX: partial rotary, parallel
residual; Qwen2-MoE: routed experts), as real processes, 1P1D (KV over shared memory) and
colocated, chunked prefill (16-token steps), prefix cache on: concurrent completions through HTTP
== HF generate (fp32), and a second prompt sharing a 48-token prefix reuses its 3 blocks."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server

pytestmark = pytest.mark.slow

MAX_NEW = 10
MODES = {
    "1P1D": [
        "--prefill-workers",
        "1",
        "--decode-workers",
        "1",
        "--kv-transport",
        "shm",
        "--local-prefill-max-tokens",
        "0",
    ],
    "colocated": ["--colocated"],
}


@pytest.fixture(scope="module", params=["gpt_neox", "qwen2_moe"])
def family(request, models_dir):
    from pdserve.modelgen.make_model import make_model

    return make_model(models_dir / f"serve-{request.param}", arch=request.param, seed=11, quiet=True)


@pytest.mark.parametrize("mode", list(MODES))
def test_served_through_transformers_matches_hf(family, mode):
    tok = AutoTokenizer.from_pretrained(family)
    shared = random_prompts(tok.vocab_size, [50], seed=13)[0]  # 3 full 16-token blocks + 2
    first, *concurrent = [shared + t for t in random_prompts(tok.vocab_size, [7, 30, 3], seed=14)]
    prompts = [first, *concurrent, *random_prompts(tok.vocab_size, [23], seed=15)]
    want = [tok.decode(hf_greedy(str(family), tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]
    with running_server(family, *MODES[mode], "--model-impl", "transformers", "--max-num-batched-tokens", "16") as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def complete(p: list[int]):
            return client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0)

        warm = complete(first)
        assert warm.choices[0].text == want[0] and warm.usage.prompt_tokens_details.cached_tokens == 0
        with cf.ThreadPoolExecutor(len(prompts) - 1) as pool:  # concurrent: decoded as one batch
            rest = list(pool.map(complete, prompts[1:]))
    assert any(want) and [r.choices[0].text for r in rest] == want[1:]
    assert [r.usage.prompt_tokens_details.cached_tokens for r in rest] == [48, 48, 0]
