"""Sampling on a CUDA device: temperature / top-k / top-p / min-p draws, penalties and logit bias,
logprobs, n > 1 and beam search run on CUDA logits, and give what the CPU engine gives on the same
weights and seeds (a draw's noise comes from a CPU generator on every device, so a seed means the
same on a CPU and a GPU worker). Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CASES = {
    "top_k_top_p": SamplingParams(max_tokens=16, temperature=0.9, top_k=50, top_p=0.9, seed=7),
    "min_p": SamplingParams(max_tokens=16, temperature=1.2, min_p=0.05, seed=8),
    "penalties_bias": SamplingParams(
        max_tokens=16,
        temperature=0.0,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias=((5, 3.0), (9, -100.0)),
    ),
    "logprobs": SamplingParams(max_tokens=8, temperature=0.7, seed=3, logprobs=5),
    "n3": SamplingParams(max_tokens=12, temperature=1.0, seed=11, n=3),
    "beams": SamplingParams(max_tokens=10, temperature=0.0, n=2, best_of=3, use_beam_search=True),
}


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def engine_on(model, device: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            dtype="float32",
            device=device,
            cache=CacheConfig(block_size=4, num_blocks=256),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=256),
        ),
        show_progress=False,
    )


def run(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams) -> tuple[list, list]:
    """(each prompt's choices' tokens, each prompt's logprobs of its first choice)."""
    tokens: dict[str, list[list[int]]] = {}
    logprobs: dict[str, list] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
        tokens[f"r{i}"] = [[] for _ in range(sp.n)]
        logprobs[f"r{i}"] = []
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id][o.seq_index].extend(o.new_token_ids)
            if o.logprobs and o.seq_index == 0:
                logprobs[o.request_id].extend(o.logprobs)
    engine.pool.assert_all_free()
    keys = [f"r{i}" for i in range(len(prompts))]
    return [tokens[k] for k in keys], [logprobs[k] for k in keys]


@pytest.mark.parametrize("name", list(CASES))
def test_sampling_on_cuda_equals_the_cpu_engine(tiny_llama, name):
    sp = CASES[name]
    cpu, gpu = engine_on(tiny_llama, "cpu"), engine_on(tiny_llama, "cuda")
    assert gpu.runner.kv_cache.is_cuda
    prompts = random_prompts(cpu.model_config.vocab_size, [5, 17, 33], seed=21)
    want_tokens, want_lp = run(cpu, prompts, sp)
    got_tokens, got_lp = run(gpu, prompts, sp)
    assert got_tokens == want_tokens
    assert sum(len(c) for choices in got_tokens for c in choices) > 2 * len(prompts)
    if sp.n > 1 and not sp.use_beam_search:
        assert any(len({tuple(c) for c in choices}) > 1 for choices in got_tokens), "n choices all alike"
    if sp.logprobs is not None:
        for want_row, got_row, choices in zip(want_lp, got_lp, got_tokens, strict=True):
            assert len(got_row) == len(choices[0])
            for w, g in zip(want_row, got_row, strict=True):
                assert g.token_id == w.token_id and g.top_ids == w.top_ids
                assert abs(g.logprob - w.logprob) < 1e-4


def test_a_seed_draws_the_same_twice_and_seeds_differ(tiny_llama):
    engine = engine_on(tiny_llama, "cuda")
    prompts = random_prompts(engine.model_config.vocab_size, [9, 12], seed=4)
    first = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=5))
    again = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=5))
    other = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, seed=6))
    assert first == again and first != other
