"""Qwen3 and Phi-4-mini-style Phi-3 served as real processes, 1P1D (KV over shared memory) and
colocated, chunked prefill, prefix cache on: greedy completions through HTTP == HF generate (fp32),
and again once their prompts are cached."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server
from tests.e2e.test_transformers_backend_serving import MODES

pytestmark = pytest.mark.slow

MAX_NEW = 10


@pytest.fixture(params=["qwen3", "phi4-mini"])
def family_model(request, models_dir):
    from pdserve.modelgen.make_model import make_model

    if request.param == "qwen3":
        return make_model(models_dir / "serve-qwen3", arch="qwen3", seed=8, quiet=True)
    return make_model(
        models_dir / "serve-phi4-mini",
        arch="phi3",
        seed=9,
        quiet=True,
        hf_config={"partial_rotary_factor": 0.75, "original_max_position_embeddings": 128},
        rope_scaling={
            "rope_type": "longrope",
            "short_factor": [1.0, 1.2, 1.5, 2.0, 2.5, 3.0],
            "long_factor": [4.0] * 6,
        },
    )


@pytest.mark.parametrize("mode", list(MODES))
def test_served_greedy_matches_hf(family_model, mode):
    tok = AutoTokenizer.from_pretrained(family_model)
    prompts = random_prompts(tok.vocab_size, [7, 40, 23], seed=12)
    want = [tok.decode(hf_greedy(str(family_model), tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]
    with running_server(family_model, *MODES[mode], "--max-num-batched-tokens", "16") as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def complete(p: list[int]) -> str:
            r = client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0)
            return r.choices[0].text

        with cf.ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: decoded as one batch
            got = list(pool.map(complete, prompts))
        again = [complete(p) for p in prompts]  # their full blocks now cached (prefix cache on by default)
    assert any(want) and got == want and again == want
