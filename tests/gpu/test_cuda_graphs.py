"""Decode steps replayed from CUDA graphs (engine/cuda_graphs.py) give what eager steps give:
greedy output equals HF transformers on the same GPU (fp32, no TF32) while the batch shrinks
through several buckets and contexts cross a context bucket; seeded sampling, penalties,
logprobs and n > 1 draw the same tokens; a windowed, soft-capped family too. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.cuda_graphs import MIN_CONTEXT_BUCKET
from pdserve.engine.llm_engine import LLMEngine
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import random_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def engine(model, eager: bool, max_model_len=512, num_blocks=512, dtype="float32") -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=str(model),
            dtype=dtype,
            device="cuda",
            enforce_eager=eager,
            cache=CacheConfig(block_size=16, num_blocks=num_blocks),
            scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096, max_model_len=max_model_len),
        ),
        show_progress=False,
    )


def run(eng: LLMEngine, prompts, params: list[SamplingParams]) -> dict[str, list]:
    """Each prompt with its own params (so sequences end at different steps and the batch
    shrinks): request id -> [(choice, token ids, logprobs)]."""
    out: dict[str, dict[int, tuple[list[int], list]]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        eng.add_request(f"r{i}", p, sp)
    while eng.has_work():
        for o in eng.step():
            toks, lps = out.setdefault(o.request_id, {}).setdefault(o.seq_index, ([], []))
            toks.extend(o.new_token_ids)
            lps.extend(o.logprobs or [])
    eng.pool.assert_all_free()
    return {r: [(k, *v) for k, v in sorted(choices.items())] for r, choices in out.items()}


def hf_greedy(model, prompts, lengths):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).cuda().eval()
    outs = []
    with torch.no_grad():
        for p, n in zip(prompts, lengths):
            ids = torch.tensor([p], device="cuda")
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, pad_token_id=0
            )
            outs.append(out[0, len(p) :].tolist())
    return outs


def test_graphed_decode_equals_hf_and_eager_as_the_batch_shrinks(tiny_llama):
    prompts = random_prompts(512, [5, 17, 33, 64, 3, 100, 9, 41, 12, 70, 2, 28], seed=21)
    lengths = [4 + 3 * i for i in range(len(prompts))]  # 12 sequences ending one by one: buckets 16, 8, 4, 2, 1
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    graphed = engine(tiny_llama, eager=False)
    got = run(graphed, prompts, params)
    graphs = graphed.runner.decode_graphs
    assert graphs is not None and {bp for bp, _ in graphs.graphs} >= {16, 8, 4, 2, 1}
    eager = engine(tiny_llama, eager=True)
    assert eager.runner.decode_graphs is None
    assert run(eager, prompts, params) == got
    assert [got[f"r{i}"][0][1] for i in range(len(prompts))] == hf_greedy(tiny_llama, prompts, lengths)


def test_contexts_crossing_a_bucket_replay_exactly(models_dir):
    from pdserve.modelgen.make_model import make_model

    model = make_model(models_dir / "graphs-bench", preset="bench", arch="llama", seed=3, quiet=True)
    prompts = random_prompts(8192, [MIN_CONTEXT_BUCKET - 20, MIN_CONTEXT_BUCKET - 5, 300], seed=4)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 3
    graphed = engine(model, eager=False, max_model_len=4096, num_blocks=1024)
    got = run(graphed, prompts, params)
    assert graphed.runner.decode_graphs is not None
    assert {cp for _, cp in graphed.runner.decode_graphs.graphs} == {MIN_CONTEXT_BUCKET, 2 * MIN_CONTEXT_BUCKET}
    assert got == run(engine(model, eager=True, max_model_len=4096, num_blocks=1024), prompts, params)
    assert [got[f"r{i}"][0][1] for i in range(3)] == hf_greedy(model, prompts, [40] * 3)


def test_sampling_penalties_logprobs_and_n_draw_the_same_with_graphs(tiny_llama):
    prompts = random_prompts(512, [7, 30, 65, 12], seed=8)
    params = [
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=1, logprobs=3),
        SamplingParams(max_tokens=25, temperature=1.0, top_k=20, presence_penalty=0.5, seed=2),
        SamplingParams(max_tokens=15, temperature=0.7, n=3, seed=3, repetition_penalty=1.2),
        SamplingParams(max_tokens=30, temperature=0.0, frequency_penalty=0.3, logprobs=2),
    ]
    got = run(engine(tiny_llama, eager=False), prompts, params)
    want = run(engine(tiny_llama, eager=True), prompts, params)
    assert got.keys() == want.keys()
    for rid in want:
        for (k, toks, lps), (k2, toks2, lps2) in zip(got[rid], want[rid], strict=True):
            assert (k, toks) == (k2, toks2)
            for a, b in zip(lps, lps2, strict=True):
                assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_a_windowed_soft_capped_family_replays_exactly(models_dir):
    from pdserve.modelgen.make_model import make_model
    from tests.engine.test_sliding_window_models import FAMILIES, prompts_for

    model = make_model(models_dir / "graphs-gemma2", quiet=True, **FAMILIES["gemma2"])
    eng = engine(model, eager=False)
    prompts = prompts_for(eng.model_config.vocab_size)
    params = [SamplingParams(max_tokens=24, temperature=0.0)] * len(prompts)
    assert run(eng, prompts, params) == run(engine(model, eager=True), prompts, params)
    assert eng.runner.decode_graphs is not None and eng.runner.decode_graphs.graphs


def test_bf16_graphs_run(tiny_llama):
    eng = engine(tiny_llama, eager=False, dtype="bfloat16")
    outs = eng.generate(random_prompts(512, [5, 50, 200], seed=2), SamplingParams(max_tokens=16, temperature=0.0))
    assert all(len(o) == 16 for o in outs) and eng.runner.decode_graphs is not None
    assert eng.runner.decode_graphs.graphs
