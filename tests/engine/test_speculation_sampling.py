"""Speculation with sampling (temperature > 0) and constraints: the emitted tokens follow the
target's distribution (a two-sample chi-square test against no speculation, with a control
showing the test tells a different temperature apart), seeded requests give the very tokens and
logprobs they give without speculation, run after run, and a grammar-constrained request is
unchanged by speculation."""

from __future__ import annotations

import json
from collections import Counter

import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.protocol.sampling import SamplingParams, StructuredOutput
from tests.conftest import random_prompts
from tests.engine.test_speculation import SPEC, make_engine

WIDE = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=64)  # speculate in big batches too


def loop_prompt(vocab: int) -> list[int]:
    phrase = random_prompts(vocab, [5], seed=8)[0]
    return phrase * 4


def outputs(engine: LLMEngine, prompts: list[list[int]], sp: SamplingParams) -> list[list[int]]:
    out = engine.generate(prompts, sp)
    engine.pool.assert_all_free()
    return out


def chi_square_p(a: Counter, b: Counter, min_count: int = 10) -> float:
    """Two-sample chi-square test of equal distributions; rare categories pooled into one."""
    keys = [k for k in a.keys() | b.keys() if a[k] + b[k] >= min_count]
    rest = (sum(a.values()) - sum(a[k] for k in keys), sum(b.values()) - sum(b[k] for k in keys))
    table = torch.tensor([[a[k], b[k]] for k in keys] + ([list(rest)] if sum(rest) else []), dtype=torch.float64)
    if table.shape[0] < 2:
        return 1.0
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()  # [C, 2]
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[0] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def per_position(samples: list[list[int]]) -> list[Counter]:
    return [Counter(s[i] for s in samples if len(s) > i) for i in range(max(map(len, samples)))]


def test_sampled_tokens_follow_the_target_distribution(tiny_llama):
    n, max_new = 600, 6
    # unseeded requests: the engines' own generators draw (seeded here, so the test is repeatable)
    base = make_engine(tiny_llama, spec=None, max_num_seqs=64, num_blocks=1024, seed=1)
    spec = make_engine(tiny_llama, spec=WIDE, max_num_seqs=64, num_blocks=1024, seed=2)
    prompt = loop_prompt(base.model_config.vocab_size)
    sp = SamplingParams(max_tokens=max_new, temperature=0.8)
    without = outputs(base, [prompt] * n, sp)
    with_spec = outputs(spec, [prompt] * n, sp)
    assert spec.speculator is not None
    st = spec.speculator.stats
    assert st.num_accepted_tokens > n and st.num_accepted_tokens < st.num_draft_tokens, st  # both outcomes, often
    p_values = [chi_square_p(x, y) for x, y in zip(per_position(without), per_position(with_spec))]
    assert min(p_values) > 1e-3, p_values
    # the control: the same test tells temperature 0.5 from 0.8 at this sample size
    colder = outputs(base, [prompt] * n, SamplingParams(max_tokens=max_new, temperature=0.5))
    control = [chi_square_p(x, y) for x, y in zip(per_position(without), per_position(colder))]
    assert min(control) < 1e-3, control


def test_seeded_requests_match_no_speculation_and_repeat(tiny_qwen2):
    base = make_engine(tiny_qwen2, spec=None)
    prompts = [loop_prompt(base.model_config.vocab_size)] * 3 + random_prompts(base.model_config.vocab_size, [9], 5)
    results = []
    for engine in (base, make_engine(tiny_qwen2, spec=SPEC), make_engine(tiny_qwen2, spec=SPEC)):
        got = []
        for i, p in enumerate(prompts):
            sp = SamplingParams(max_tokens=24, temperature=0.7, seed=100 + i, logprobs=2)
            engine.add_request(f"r{i}", p, sp)
        outs: dict[str, tuple[list[int], list]] = {f"r{i}": ([], []) for i in range(len(prompts))}
        while engine.has_work():
            for o in engine.step():
                outs[o.request_id][0].extend(o.new_token_ids)
                outs[o.request_id][1].extend(o.logprobs or [])
        engine.pool.assert_all_free()
        for tokens, lps in outs.values():
            assert [lp.token_id for lp in lps] == tokens
            got.append((tokens, [round(lp.logprob, 4) for lp in lps], [lp.top_ids for lp in lps]))
        results.append(got)
        if engine.speculator is not None:
            assert engine.speculator.stats.num_accepted_tokens > 0
    assert results[1] == results[0]  # tokens, logprobs and top logprobs as without speculation
    assert results[2] == results[1]


def test_grammar_constrained_output_is_unchanged(tiny_llama):
    regex = StructuredOutput("regex", r"(ab|cd)([0-9]{2}-){3,12}")
    choice = StructuredOutput("choice", json.dumps(["yes yes yes yes yes", "no"]))
    base, spec = make_engine(tiny_llama, spec=None), make_engine(tiny_llama)
    prompts = random_prompts(base.model_config.vocab_size, [7, 12], seed=4)
    for c in (regex, choice):
        for sp in (
            SamplingParams(max_tokens=60, temperature=0.0, structured=c),
            SamplingParams(max_tokens=60, temperature=0.9, seed=5, structured=c),
        ):
            assert outputs(spec, prompts, sp) == outputs(base, prompts, sp)
    assert spec.speculator is not None and spec.speculator.stats.num_accepted_tokens > 0
