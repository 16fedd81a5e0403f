"""The engine on a CUDA device (Triton attention): greedy output equals HF transformers on the
same device and weights (fp32, no TF32), single, ragged, chunked and preempted; bf16 runs.
Skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import hf_attention, random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MAX_NEW = 24
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
LENGTHS = [5, 17, 33, 64, 3, 100]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def cuda_engine(
    model, dtype="float32", block_size=16, num_blocks=256, budget=512, max_model_len=256, kv_cache_dtype="auto"
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            device="cuda",
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, max_model_len=max_model_len),
        ),
        show_progress=False,
    )


def hf_greedy_cuda(model, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32, **hf_attention(str(model))).cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=0
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize("mode", ["single", "ragged", "chunked", "preempted"])
def test_greedy_on_cuda_equals_hf(tiny_model, mode):
    kw = {
        "chunked": dict(block_size=4, budget=7),
        "preempted": dict(block_size=4, num_blocks=48, max_model_len=160),
    }.get(mode, {})
    engine = cuda_engine(tiny_model, **kw)
    assert engine.runner.kv_cache.is_cuda
    prompts = random_prompts(engine.model_config.vocab_size, LENGTHS, seed=5)
    want = hf_greedy_cuda(tiny_model, prompts)
    if mode == "single":
        got = [engine.generate([p], GREEDY)[0] for p in prompts]
    else:
        got = engine.generate(prompts, GREEDY)
    assert got == want
    engine.pool.assert_all_free()


def test_bf16_on_cuda_runs_and_mostly_agrees(tiny_llama):
    engine = cuda_engine(tiny_llama, dtype="bfloat16")
    prompts = random_prompts(engine.model_config.vocab_size, LENGTHS, seed=6)
    outs = engine.generate(prompts, GREEDY)
    assert all(len(o) == MAX_NEW for o in outs)
    want = hf_greedy_cuda(tiny_llama, prompts)
    first_tokens_equal = sum(o[0] == w[0] for o, w in zip(outs, want))
    assert first_tokens_equal >= len(prompts) - 1  # bf16 rounding may flip a near tie
    engine.pool.assert_all_free()


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral", "qwen2"])
@pytest.mark.parametrize("budget", [512, 13])
def test_sliding_window_families_on_cuda_equal_hf(models_dir, family, budget):
    """Per-layer windows (32 tokens) and Gemma's soft-capping through the Triton kernels: prompts
    past the window, a warm prefix cache, chunks starting inside and past the window."""
    from pdserve.modelgen.make_model import make_model
    from tests.engine.test_sliding_window_models import FAMILIES, prompts_for

    model = make_model(models_dir / f"swa-{family}", quiet=True, **FAMILIES[family])
    engine = cuda_engine(model, budget=budget)
    prompts = prompts_for(engine.model_config.vocab_size)
    want = hf_greedy_cuda(model, prompts)
    assert engine.generate(prompts, GREEDY) == want
    if budget == 512:
        hits = engine.scheduler.prefix_hit_tokens
        assert engine.generate(prompts, GREEDY) == want
        assert engine.scheduler.prefix_hit_tokens > hits
    engine.pool.assert_all_free()


def test_ngram_speculation_on_cuda_equals_hf(tiny_llama):
    from pdserve.engine.spec.config import SpeculativeConfig
    from tests.engine.test_speculation import prompts_for as spec_prompts

    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_llama),
            dtype="float32",
            device="cuda",
            cache=CacheConfig(block_size=4, num_blocks=256),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=256),
            speculative=SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1),
        ),
        show_progress=False,
    )
    prompts = spec_prompts(engine.model_config.vocab_size)
    assert engine.generate(prompts, GREEDY) == hf_greedy_cuda(tiny_llama, prompts)
    assert engine.speculator is not None and engine.speculator.stats.num_drafts > 0
    engine.pool.assert_all_free()


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_on_cuda_reads_as_torch_does(tiny_model, kv_cache_dtype, monkeypatch):
    """A CUDA pool of int8 / fp8 rows (written by torch's quantizing store): the Triton kernels'
    greedy output equals torch's attention over the same pool, chunked and ragged."""
    from pdserve.env import reload

    outs = {}
    for attention in ("triton", "torch"):
        monkeypatch.setenv("PDSERVE_ATTENTION", attention)
        reload()
        engine = cuda_engine(tiny_model, block_size=4, budget=7, kv_cache_dtype=kv_cache_dtype)
        assert engine.runner.kv_cache.is_cuda and engine.runner.kv_cache.dtype in (torch.int8, torch.uint8)
        prompts = random_prompts(engine.model_config.vocab_size, LENGTHS, seed=7)
        outs[attention] = engine.generate(prompts, GREEDY)
        engine.pool.assert_all_free()
    assert outs["triton"] == outs["torch"]
