"""bf16 on the CPU: decode steps read the linears' bf16 panel copies (the C few-row GEMM, fp32
sums rounded once) and agree with Hugging Face transformers in bf16 on every token's logprob."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.models.cpu_linear import TransposedLinear
from pdserve.kernels import panel_gemm
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import random_prompts

pytestmark = pytest.mark.skipif(not panel_gemm.available(), reason="no C compiler: torch only")

NEW_TOKENS = 8


def _hf_bf16(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()


def test_bf16_decode_reads_panels_and_matches_hf_logprobs(tiny_model, monkeypatch):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model),
            dtype="bfloat16",
            cache=CacheConfig(block_size=16, num_blocks=64),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=128),
        ),
        show_progress=False,
    )
    linears = [m for m in engine.runner.model.modules() if isinstance(m, TransposedLinear)]
    assert linears and all(m.panels is not None and m.panels.dtype == torch.bfloat16 for m in linears)
    rows_seen = []
    real = panel_gemm.linear
    monkeypatch.setattr(panel_gemm, "linear", lambda x, *a: rows_seen.append(x.shape[0]) or real(x, *a))

    prompts = random_prompts(engine.model_config.vocab_size, [5, 17, 30], seed=7)
    sp = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    logprobs: dict[str, list[float]] = {k: [] for k in tokens}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, sp)
    while engine.has_work():
        for o in engine.step():
            tokens[o.request_id] += o.new_token_ids
            logprobs[o.request_id] += [t.logprob for t in o.logprobs or []]
    engine.pool.assert_all_free()
    assert len(prompts) in rows_seen  # the three sequences' decode steps took the panels

    hf = _hf_bf16(str(tiny_model))
    for i, p in enumerate(prompts):
        got, lps = tokens[f"r{i}"], logprobs[f"r{i}"]
        assert len(got) == len(lps) == NEW_TOKENS
        ids = torch.tensor([p + got[:-1]])  # teacher-forced on the engine's own tokens
        with torch.no_grad():
            logits = hf(ids).logits[0, len(p) - 1 :].float()  # [NEW_TOKENS, V]: the positions that chose them
        want = torch.log_softmax(logits, dim=-1)[torch.arange(NEW_TOKENS), torch.tensor(got)]
        # bf16 rounds every activation: logprobs agree to bf16's few significant bits, not exactly
        torch.testing.assert_close(torch.tensor(lps), want, atol=0.1, rtol=0.05)
