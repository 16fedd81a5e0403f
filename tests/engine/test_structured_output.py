"""Constrained decoding in the engine: on a random-weight model only the grammar makes outputs
valid, so every one of ~100 sampled requests validating is the grammar's doing. Also: mixed
batches leave unconstrained rows as they were (HF greedy), max_tokens mid-structure is "length",
n > 1 members each follow the constraint, and the disaggregated (first token on P) and migrated
(matcher replayed from the prompt's tail) paths give what one engine gives."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from transformers import AutoTokenizer

from pdserve.engine.llm_engine import PREFILLED, LLMEngine
from pdserve.protocol.sampling import SamplingParams, StructuredOutput
from tests.conftest import hf_greedy, random_prompts
from tests.engine.test_engine_vs_hf import make_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "kind": {"enum": ["prefill", "decode", "cache"]},
        "score": {"type": "integer", "minimum": -5, "maximum": 300},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "zip": {"type": "string", "pattern": "^[0-9]{3}$"}},
            "required": ["ok", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "score", "tags", "where"],
    "additionalProperties": False,
}
REGEX = r"(ab|cd)[0-9]{2,4}-[a-z]{1,3}"
CHOICES = ["yes", "no", "maybe not", "é ok"]


def schema_c(schema: dict = SCHEMA) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


def regex_c() -> StructuredOutput:
    return StructuredOutput("regex", REGEX)


def choice_c() -> StructuredOutput:
    return StructuredOutput("choice", json.dumps(CHOICES))


@pytest.fixture(scope="module")
def tok(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, tuple[list[int], str]]:
    """Add all, step to the end: request id -> (output tokens, finish reason)."""
    out: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    for rid, (prompt, sp) in requests.items():
        engine.add_request(rid, prompt, sp)
        out[rid] = []
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                reasons[o.request_id] = o.finish_reason
    engine.pool.assert_all_free()
    return {rid: (out[rid], reasons[rid]) for rid in requests}


def check_valid(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def test_a_hundred_sampled_requests_all_follow_their_constraint(tiny_llama, tok):
    engine = make_engine(tiny_llama, num_blocks=512, max_num_seqs=32)
    vocab = engine.model_config.vocab_size
    prompts = random_prompts(vocab, [5 + i % 13 for i in range(102)], seed=11)
    kinds = {"json": schema_c(), "regex": regex_c(), "choice": choice_c()}
    requests = {
        f"{kind}-{i}": (prompts[i], SamplingParams(max_tokens=150, temperature=1.0, seed=i, structured=kinds[kind]))
        for i, kind in enumerate(["json", "regex", "choice"] * 34)
    }
    results = run(engine, requests)
    for rid, (tokens, reason) in results.items():
        assert reason == "stop", (rid, tok.decode(tokens))
        check_valid(rid.split("-")[0], tok.decode(tokens, skip_special_tokens=True))
    assert len({tuple(t) for t, _ in results.values()}) > 60  # really sampled: the seeds differ


def test_unconstrained_rows_in_a_constrained_batch_stay_hf_greedy(tiny_llama, tok):
    engine = make_engine(tiny_llama)
    prompts = random_prompts(engine.model_config.vocab_size, [7, 12, 9, 15], seed=4)
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    requests = {
        "free-0": (prompts[0], free),
        "json": (prompts[1], SamplingParams(max_tokens=150, temperature=0.0, structured=schema_c())),
        "free-1": (prompts[2], free),
        "regex": (prompts[3], SamplingParams(max_tokens=30, temperature=0.7, seed=3, structured=regex_c())),
    }
    results = run(engine, requests)
    for rid in ("free-0", "free-1"):
        prompt = requests[rid][0]
        assert results[rid][0] == hf_greedy(str(tiny_llama), tuple(prompt), 12)
    check_valid("json", tok.decode(results["json"][0], skip_special_tokens=True))
    check_valid("regex", tok.decode(results["regex"][0], skip_special_tokens=True))


def test_max_tokens_mid_structure_is_length(tiny_llama, tok):
    engine = make_engine(tiny_llama)
    prompt = random_prompts(engine.model_config.vocab_size, [9], seed=2)[0]
    (tokens, reason) = run(engine, {"j": (prompt, SamplingParams(max_tokens=6, structured=schema_c()))})["j"]
    assert reason == "length" and len(tokens) == 6
    text = tok.decode(tokens)
    assert text.startswith('{"n')  # a prefix of the structure, not a document
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_n_members_each_follow_the_constraint(tiny_llama, tok):
    engine = make_engine(tiny_llama, num_blocks=256)
    prompt = random_prompts(engine.model_config.vocab_size, [10], seed=5)[0]
    sp = SamplingParams(max_tokens=150, temperature=1.0, seed=9, n=4, structured=schema_c())
    engine.add_request("g", prompt, sp)
    out: list[list[int]] = [[] for _ in range(4)]
    reasons: dict[int, str] = {}
    while engine.has_work():
        for o in engine.step():
            out[o.seq_index] += o.new_token_ids
            if o.finish_reason:
                reasons[o.seq_index] = o.finish_reason
    engine.pool.assert_all_free()
    assert reasons == dict.fromkeys(range(4), "stop")
    for tokens in out:
        check_valid("json", tok.decode(tokens, skip_special_tokens=True))
    assert len({tuple(t) for t in out}) > 1


def _prefill(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int], sp: SamplingParams):
    """P prefills and samples the first token(s) under the constraint; its KV is copied to D's
    blocks; D admits the sequence (and rebuilds its matcher from the constraint)."""
    prefill.add_request(rid, prompt, sp, prefill_only=True)
    sched = prefill.schedule()
    src = list(sched.chunks[0].seq.block_table)
    (o,) = prefill.execute(sched)
    assert o.finish_reason == PREFILLED
    dst = decode.pool.allocate(len(src))
    decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src]  # [L, 2, n, bs, H, D]
    first = o.new_token_ids[0] if o.new_token_ids else 0
    return decode.add_prefilled(rid, prompt, first, None, sp, dst, fork=o.fork), first


def _drain(engine: LLMEngine, outs: dict[int, list[int]]) -> None:
    while engine.has_work():
        for o in engine.step():
            outs.setdefault(o.seq_index, []).extend(o.new_token_ids)
    engine.pool.assert_all_free()


@pytest.mark.parametrize("n", [1, 3])
def test_disaggregated_equals_one_engine(tiny_llama, tok, n):
    """Seeded sampling: P's first token(s) and D's rest equal what one engine draws."""
    prompt = random_prompts(512, [14], seed=8)[0]
    sp = SamplingParams(max_tokens=150, temperature=1.0, seed=21, n=n, structured=schema_c())
    whole: dict[int, list[int]] = {}
    one = make_engine(tiny_llama)
    one.add_request("r", prompt, sp)
    _drain(one, whole)
    prefill, decode = make_engine(tiny_llama), make_engine(tiny_llama)
    outs, first = _prefill(prefill, decode, "r", prompt, sp)
    split: dict[int, list[int]] = {0: [first]} if n == 1 else {}
    for o in outs:
        split.setdefault(o.seq_index, []).extend(o.new_token_ids)
    _drain(decode, split)
    assert split == whole
    for tokens in split.values():
        check_valid("json", tok.decode(tokens, skip_special_tokens=True))


def test_migration_replays_the_generated_tokens(tiny_llama, tok):
    """A request moved after k tokens: prompt + those k, resumed_tokens=k; greedy, the rest is
    what the unmoved request made."""
    prompt = random_prompts(512, [11], seed=6)[0]
    sp = SamplingParams(max_tokens=150, temperature=0.0, structured=schema_c())
    (whole, _) = run(make_engine(tiny_llama), {"r": (prompt, sp)})["r"]
    k = 9
    moved = SamplingParams(
        max_tokens=150 - k,
        temperature=0.0,
        structured=StructuredOutput("json_schema", sp.structured.spec, resumed_tokens=k),
    )  # type: ignore[union-attr]
    (rest, reason) = run(make_engine(tiny_llama), {"r": (prompt + whole[:k], moved)})["r"]
    assert reason == "stop" and whole[:k] + rest == whole
    check_valid("json", tok.decode(whole, skip_special_tokens=True))


def test_a_bad_constraint_or_replay_is_refused_at_add_request(tiny_llama):
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match="regex"):
        engine.add_request("a", [5, 6], SamplingParams(structured=StructuredOutput("regex", "[a-")))
    bad = StructuredOutput("choice", json.dumps(["yes"]), resumed_tokens=2)
    with pytest.raises(ValueError, match="resumed tokens"):
        engine.add_request("b", [5, 6, 7], SamplingParams(structured=bad))
    with pytest.raises(ValueError, match="beam"):
        SamplingParams(use_beam_search=True, n=2, temperature=0.0, structured=regex_c())


def test_constrained_greedy_equals_hf_generate_under_the_same_mask(tiny_llama, tok):
    """Which tokens come out, checked against transformers, not pdserve: HF generate with a logits
    processor applying the same grammar's mask, greedy, fp32, on the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList

    from pdserve.engine.structured.bitmask import allocate_bitmask, apply_bitmask
    from pdserve.engine.structured.matcher import GrammarCache

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    cfg = hf.config
    eos = [cfg.eos_token_id] if isinstance(cfg.eos_token_id, int) else list(cfg.eos_token_id)
    cache = GrammarCache(tiny_llama, cfg.vocab_size, eos)

    class GrammarMask(LogitsProcessor):
        def __init__(self, c: StructuredOutput, prompt_len: int) -> None:
            self.grammar, self.prompt_len = cache.new(c), prompt_len

        def __call__(self, input_ids, scores):  # input_ids [1, T], scores [1, V]
            if input_ids.shape[1] > self.prompt_len:
                assert self.grammar.accept(int(input_ids[0, -1]))
            if self.grammar.terminated:  # pdserve ends here ("stop"); HF may only end on EOS
                scores[:, :] = float("-inf")
                scores[0, eos[0]] = 0.0
                return scores
            mask = allocate_bitmask(1, scores.shape[1])
            self.grammar.fill(mask, 0)
            apply_bitmask(scores, mask)
            return scores

    engine = make_engine(tiny_llama)
    prompts = random_prompts(tok.vocab_size, [5, 13, 21], seed=3)
    constraints = [schema_c(), regex_c(), choice_c()]
    requests, want = {}, {}
    for i, p in enumerate(prompts):
        for j, c in enumerate(constraints):
            rid = f"r{i}-{j}"
            requests[rid] = (p, SamplingParams(max_tokens=60, temperature=0.0, structured=c))
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([p]),
                    max_new_tokens=60,
                    do_sample=False,
                    logits_processor=LogitsProcessorList([GrammarMask(c, len(p))]),
                    pad_token_id=eos[0],
                )
            got = out[0, len(p) :].tolist()
            want[rid] = [t for t in got[: next((k for k, t in enumerate(got) if t in eos), len(got))]]
    outs = run(engine, requests)
    got = {rid: [t for t in outs[rid][0] if t not in eos] for rid in requests}  # (an EOS the grammar let through)
    assert all(want.values()) and got == want, {rid: (got[rid], want[rid]) for rid in requests if got[rid] != want[rid]}


def test_the_grammar_tokenizer_is_built_ahead_of_the_first_constraint(tiny_llama, tmp_path):
    """Workers warm it at start (a first constraint then costs no tokenizer load); a folder without
    a tokenizer fails at the first constraint, not in the warming thread."""
    from pdserve.engine.structured.matcher import GrammarCache, TokenizerLoad

    choice = StructuredOutput("choice", json.dumps(["yes", "no"]))
    cache = GrammarCache(tiny_llama, 512, [0])
    cache.warm_in_background(TokenizerLoad(tiny_llama))  # the HF tokenizer's load already under way
    assert cache._warming is not None
    cache._warming.join()
    assert cache._tokenizer is not None
    assert cache.new(choice).valid_prefix([]) == 0
    broken = GrammarCache(tmp_path, 512, [0])  # no tokenizer files there
    broken.warm_in_background(TokenizerLoad(tmp_path))
    with pytest.raises(Exception):
        broken.new(choice)


_IMPORTS_WHILE_THE_TOKENIZER_LOADS = """
import sys
from pdserve.engine.structured.matcher import TokenizerLoad
loading = TokenizerLoad(sys.argv[1])
from transformers import AutoConfig, AutoModelForCausalLM  # as the transformers backend's load does
loading.result()
"""


def test_a_model_load_importing_transformers_beside_the_tokenizer_load_succeeds(tiny_llama):
    """In a fresh process (transformers not yet imported) the worker's two threads both import it:
    each of 3 starts loads both (a first import from two threads at once failed in one of them)."""
    import subprocess
    import sys

    for _ in range(3):
        run = subprocess.run(
            [sys.executable, "-c", _IMPORTS_WHILE_THE_TOKENIZER_LOADS, str(tiny_llama)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 0, run.stderr[-2000:]
