"""Prompt logprobs from the engine equal Hugging Face transformers' log_softmax of its logits over
the prompt (fp32): whole, chunked, after a prefix-cache hit, on a prefill-only engine, in groups."""

from __future__ import annotations

import functools

import pytest
import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import PREFILLED, LLMEngine
from pdserve.engine.prompt_logprobs import PromptScores, score_rows
from pdserve.protocol.messages import PromptLogprobs
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import _hf_model, random_prompts

TOL = 1e-4
K = 3


def make_engine(model, budget: int = 512) -> LLMEngine:
    cache = CacheConfig(block_size=16, num_blocks=128)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=256)
    return LLMEngine(EngineConfig(model=str(model), dtype="float32", cache=cache, scheduler=sched), show_progress=False)


@functools.lru_cache(maxsize=None)
def hf_prompt_logprobs(path: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """[L - 1, V]: row i is log_softmax of HF's logits at position i (it scores token i + 1)."""
    with torch.no_grad():
        logits = _hf_model(path)(torch.tensor([prompt])).logits[0].float()  # [L, V]
    return logits[:-1].log_softmax(dim=-1)


def check(model, prompt: list[int], got: PromptLogprobs, k: int = K) -> float:
    """Asserts `got` matches HF; returns the largest |difference| of a token's logprob."""
    want = hf_prompt_logprobs(str(model), tuple(prompt))
    targets = torch.tensor(prompt[1:])
    want_lp = want.gather(1, targets[:, None]).squeeze(1)
    assert len(got.logprobs) == len(prompt) - 1
    diff = (torch.tensor(got.logprobs) - want_lp).abs().max().item() if len(prompt) > 1 else 0.0
    assert diff <= TOL
    want_rank = (want > want_lp[:, None]).sum(dim=1) + 1
    assert got.ranks == want_rank.tolist()
    top = want.topk(k, dim=-1)
    for i in range(len(prompt) - 1):
        assert got.top_ids[i] == top.indices[i].tolist()
        assert torch.allclose(torch.tensor(got.top_logprobs[i]), top.values[i], atol=TOL)
    return diff


def run(engine: LLMEngine, prompt: list[int], sampling: SamplingParams, request_id: str = "r") -> list:
    engine.add_request(request_id, prompt, sampling)
    outs = []
    while engine.has_work():
        outs += [o for o in engine.step() if o.request_id == request_id]
    return outs


GREEDY = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=K)


@pytest.mark.parametrize("budget", [512, 7])  # whole prompts, and chunks of 7 tokens
def test_matches_hf_and_comes_with_the_first_output_only(tiny_model, budget):
    engine = make_engine(tiny_model, budget)
    for prompt in random_prompts(engine.model_config.vocab_size, [2, 17, 40], seed=5):
        outs = run(engine, prompt, GREEDY)
        assert outs[0].prompt_logprobs is not None
        assert all(o.prompt_logprobs is None for o in outs[1:])
        check(tiny_model, prompt, outs[0].prompt_logprobs)
    engine.pool.assert_all_free()


def test_a_one_token_prompt_has_no_scores(tiny_llama):
    outs = run(make_engine(tiny_llama), [5], GREEDY)
    assert outs[0].prompt_logprobs == PromptLogprobs([], [], [], [])


def test_a_cached_prefix_is_computed_again(tiny_llama):
    """The prompt's blocks are in the prefix cache after the first run; asking for prompt
    logprobs computes every position anyway (and a later plain request still reuses them)."""
    engine = make_engine(tiny_llama)
    prompt = random_prompts(engine.model_config.vocab_size, [50], seed=9)[0]
    run(engine, prompt, SamplingParams(max_tokens=2, temperature=0.0), "warm")
    outs = run(engine, prompt, GREEDY, "scored")
    assert outs[0].num_cached_tokens == 0
    check(tiny_llama, prompt, outs[0].prompt_logprobs)
    plain = run(engine, prompt, SamplingParams(max_tokens=2, temperature=0.0), "plain")
    assert plain[0].num_cached_tokens == 48


def test_prefill_only_engine_and_groups(tiny_llama):
    """A prefill worker's sequence (its first token ends it) and a group's root (n = 2, here and
    prefill-only) carry the scores out once."""
    engine = make_engine(tiny_llama, budget=9)
    prompt = random_prompts(engine.model_config.vocab_size, [30], seed=4)[0]
    engine.add_request("p", prompt, GREEDY, prefill_only=True)
    outs = [o for _ in range(10) for o in engine.step()]
    assert len(outs) == 1 and outs[0].finish_reason == PREFILLED
    check(tiny_llama, prompt, outs[0].prompt_logprobs)

    group = SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=2, prompt_logprobs=K)
    outs = run(engine, prompt, group, "g")
    carried = [o for o in outs if o.prompt_logprobs is not None]
    assert len(carried) == 1 and outs[0] is carried[0]
    check(tiny_llama, prompt, carried[0].prompt_logprobs)

    engine.add_request("gp", prompt, group, prefill_only=True)
    outs = [o for _ in range(10) for o in engine.step()]
    assert len(outs) == 1 and outs[0].fork is not None
    check(tiny_llama, prompt, outs[0].prompt_logprobs)
    engine.pool.assert_all_free()


def test_score_rows_slices_and_ranks():
    torch.manual_seed(0)
    logits = torch.randn(600, 50)
    targets = torch.randint(0, 50, (600,))
    lps, ranks, ids, tops = score_rows(logits, targets, 2)  # three slices of 256 rows
    want = logits.log_softmax(dim=-1)
    assert torch.allclose(torch.tensor(lps), want.gather(1, targets[:, None]).squeeze(1))
    assert ranks == ((want > want.gather(1, targets[:, None])).sum(1) + 1).tolist()
    assert ids == want.topk(2).indices.tolist()
    assert len(tops) == 600 and score_rows(logits[:3], targets[:3], 0)[2] == [[], [], []]


def test_scores_gathered_by_position():
    from pdserve.engine.prompt_logprobs import ChunkScores

    s = PromptScores(5, 1)
    s.add(ChunkScores(2, [-3.0, -4.0], [3, 4], [[1, 2], [1, 2]], [[-1.0, -2.0], [-1.0, -2.0]]))
    assert not s.complete
    s.add(ChunkScores(0, [-1.0, -2.0], [1, 2], [[7], [8]], [[-0.5], [-0.6]]))
    s.add(ChunkScores(0, [-1.5, -2.0], [1, 2], [[7], [8]], [[-0.5], [-0.6]]))  # recomputed
    assert s.complete
    msg = s.message()
    assert msg.logprobs == [-1.5, -2.0, -3.0, -4.0] and msg.top_ids[2] == [1]


def test_beside_speculating_decodes(tiny_llama):
    """A scored prompt prefilled in the steps where others verify n-gram drafts (their d + 1
    logits rows come first): its scores are right and the others still equal HF greedy."""
    from pdserve.engine.spec.config import SpeculativeConfig
    from tests.conftest import hf_greedy

    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1)
    cache = CacheConfig(block_size=4, num_blocks=256)
    sched = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=12, max_model_len=256)
    cfg = EngineConfig(model=str(tiny_llama), dtype="float32", cache=cache, scheduler=sched, speculative=spec)
    engine = LLMEngine(cfg, show_progress=False)
    phrase = random_prompts(engine.model_config.vocab_size, [6], seed=8)[0]
    repeating = phrase * 3  # the n-gram lookup finds drafts in it
    scored = random_prompts(engine.model_config.vocab_size, [40], seed=2)[0]
    outs: dict[str, list] = {"spec": [], "scored": []}
    engine.add_request("spec", repeating, SamplingParams(max_tokens=16, temperature=0.0))
    for step in range(100):
        if step == 3:  # (its prompt done: it decodes, with drafts, while this one prefills in chunks)
            engine.add_request("scored", scored, GREEDY)
        for o in engine.step():
            outs[o.request_id].append(o)
        if not engine.has_work():
            break
    assert engine.speculator is not None and engine.speculator.stats.num_drafts > 0
    check(tiny_llama, scored, outs["scored"][0].prompt_logprobs)
    tokens = [t for o in outs["spec"] for t in o.new_token_ids]
    assert tokens == hf_greedy(str(tiny_llama), tuple(repeating), 16)
