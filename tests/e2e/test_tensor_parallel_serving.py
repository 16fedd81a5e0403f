"""`pdserve serve --colocated --tensor-parallel-size 2`: real processes on loopback, the official
`openai` client, greedy output == HF generate (fp32); what it cannot split is refused at start.
(1P1D pools of their own degrees: tests/e2e/test_tensor_parallel_pools.py.)"""

from __future__ import annotations

import concurrent.futures as cf
import subprocess
import sys

import pytest
from openai import OpenAI
from transformers import AutoTokenizer

from tests.conftest import hf_greedy, random_prompts
from tests.e2e.cluster import running_server
from tests.engine.tensor_parallel_models import single_kv_head_qwen2

MAX_NEW = 16
LENGTHS = [7, 30, 65, 12]


@pytest.fixture(scope="module", params=["tiny_llama", "one_kv_head"])
def model(request, models_dir):
    """Llama with 2 KV heads (split) and Qwen2 with one (replicated on both ranks)."""
    if request.param == "one_kv_head":
        return single_kv_head_qwen2(models_dir / "tiny-qwen2-1kv")
    return request.getfixturevalue(request.param)


@pytest.mark.slow
def test_colocated_tp2_through_http_matches_hf(model):
    tok = AutoTokenizer.from_pretrained(model)
    prompts = random_prompts(tok.vocab_size, LENGTHS, seed=11)
    want = [tok.decode(hf_greedy(str(model), tuple(p), MAX_NEW), skip_special_tokens=True) for p in prompts]
    with running_server(model, "--colocated", "--tensor-parallel-size", "2", "--threads", "2") as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id

        def complete(p):
            r = client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0)
            return r.choices[0].text

        def stream(p):
            chunks = client.completions.create(model=model, prompt=p, max_tokens=MAX_NEW, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with cf.ThreadPoolExecutor(len(prompts)) as pool:  # concurrent requests: batched steps
            assert list(pool.map(complete, prompts)) == want
            assert list(pool.map(stream, prompts)) == want
        again = client.completions.create(model=model, prompt=prompts[2], max_tokens=MAX_NEW, temperature=0)
        assert again.choices[0].text == want[2]  # the prompt's blocks from the prefix cache
        assert again.usage.prompt_tokens_details.cached_tokens >= 48  # its 4 full blocks of 16, computed before


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--colocated", "--tensor-parallel-size", "3"], "does not divide the model's 4 attention heads"),
        (["--colocated", "--tensor-parallel-size", "2", "--quantization", "int8"], "quantization"),
    ],
)
def test_serve_refuses_what_tensor_parallelism_cannot_do(tiny_llama, flags, message):
    argv = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(tiny_llama), "--port", "0", *flags]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr
