"""EAGLE speculation in the engine (engine/spec/eagle.py): greedy output equals HF transformers
token for token (fp32) and the output without speculation on Llama and Qwen2, with a random head
(drafts nearly all rejected) and an "echo" head (drafts accepted and rejected at every position);
requests ending mid-verification (max_tokens, stop ids, EOS), preemption, prefix-cache hits
(the head's context then starts after the cached prefix), aborts; every proposal equals an
independent HF-module reference of the head run from scratch; every block of both pools back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.eagle import EagleRunner
from pdserve.engine.spec.eagle_hidden import HiddenRows
from pdserve.engine.weights import WeightLoadError
from pdserve.modelgen.make_eagle_head import make_eagle_head
from pdserve.modelgen.make_model import make_model_main
from pdserve.protocol.sampling import SamplingParams
from tests.engine.eagle_fixtures import echo_head, reference_proposal
from tests.engine.test_speculation import GREEDY, MAX_NEW, hf, make_engine, prompts_for


def eagle_spec(head: Path, k: int = 4) -> SpeculativeConfig:
    return SpeculativeConfig(method="eagle", model=str(head), num_speculative_tokens=k)


@pytest.fixture(scope="module")
def echo(tiny_model, tmp_path_factory) -> Path:
    return echo_head(tiny_model, tmp_path_factory.mktemp("heads") / f"echo-{tiny_model.name}", 0.5)


@pytest.fixture(scope="module")
def llama_echo(tiny_llama, tmp_path_factory) -> Path:
    return echo_head(tiny_llama, tmp_path_factory.mktemp("heads") / "echo-llama", 0.5)


def runner(engine: LLMEngine) -> EagleRunner:
    assert engine.speculator is not None and isinstance(engine.speculator.draft, EagleRunner)
    return engine.speculator.draft


def all_blocks_back(engine: LLMEngine) -> None:
    engine.pool.assert_all_free()
    head = runner(engine)
    assert not head.states, "head state kept for finished sequences"
    head.pool.assert_all_free()


def test_config_parses_vllm_names():
    spec = SpeculativeConfig.from_json('{"method": "eagle", "model": "/h", "num_speculative_tokens": 3}')
    assert (spec.method, spec.model, spec.num_speculative_tokens) == ("eagle", "/h", 3)
    with pytest.raises(ValueError, match='needs "model"'):
        SpeculativeConfig.from_json('{"method": "eagle", "num_speculative_tokens": 3}')


def test_random_head_matches_hf(tiny_model, tmp_path):
    """A random head's drafts are nearly all rejected: the output is still HF's, exactly."""
    head = make_eagle_head(tiny_model, tmp_path / "head")
    engine = make_engine(tiny_model, spec=eagle_spec(head))
    prompts = prompts_for(engine.model_config.vocab_size)
    assert engine.generate(prompts, GREEDY) == hf(tiny_model, prompts)
    assert engine.speculator is not None and engine.speculator.stats.num_drafts > 0
    all_blocks_back(engine)


@pytest.mark.slow
def test_echo_head_with_prefix_cache_matches_hf(tiny_model, echo):
    engine = make_engine(tiny_model, spec=eagle_spec(echo))
    assert engine.hasher is not None  # prefix cache on
    prompts = prompts_for(engine.model_config.vocab_size)
    want = hf(tiny_model, prompts)
    assert engine.generate(prompts, GREEDY) == want
    assert engine.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0)) == want
    st = engine.speculator.stats if engine.speculator is not None else None
    assert st is not None and 0 < st.num_accepted_tokens < st.num_draft_tokens, st
    assert all(n > 0 for n in st.accepted_per_pos), st  # accepted at every position of k = 4
    follow = [p + w + p[:3] for p, w in zip(prompts, want)]  # cached prefixes: the head starts after them
    hits = engine.scheduler.prefix_hit_tokens
    assert engine.generate(follow, GREEDY) == hf(tiny_model, follow)
    assert engine.scheduler.prefix_hit_tokens > hits
    all_blocks_back(engine)


@pytest.mark.slow
def test_every_proposal_is_the_heads_own_continuation(tiny_llama, llama_echo):
    """The head's KV bookkeeping checked directly: each proposal (after rejections rolled back,
    preemptions, prefix hits, chunked prefills) equals the head's proposal computed from scratch
    by HF modules from the target's hidden states."""
    engine = make_engine(
        tiny_llama, spec=eagle_spec(llama_echo), num_blocks=44, max_num_batched_tokens=64, max_model_len=96
    )
    head = runner(engine)
    seen: list[tuple[list[int], int, int, list[int]]] = []
    propose = head.propose

    def recording(wants):
        bases = [head.states[id(s)].base if id(s) in head.states else -1 for s, _ in wants]
        got = propose(wants)
        seen.extend((list(s.token_ids), base, k, d) for (s, k), base, d in zip(wants, bases, got))
        return got

    head.propose = recording  # type: ignore[method-assign]
    prompts = prompts_for(engine.model_config.vocab_size)
    assert engine.generate(prompts, GREEDY) == hf(tiny_llama, prompts)
    st = engine.speculator.stats if engine.speculator is not None else None
    assert st is not None and engine.scheduler.num_preemptions > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    made = [(tokens, base, k, d) for tokens, base, k, d in seen if d]
    assert len(made) > 20 and any(base > 0 for _, base, _, _ in made)  # (preempted: prefix-cache hits)
    for tokens, base, k, drafts in made:
        assert drafts == reference_proposal(tiny_llama, llama_echo, tokens, base, k), (len(tokens), base)
    all_blocks_back(engine)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 11])
def test_max_tokens_ends_mid_verification(tiny_llama, llama_echo, max_tokens):
    engine = make_engine(tiny_llama, spec=eagle_spec(llama_echo))
    prompts = prompts_for(engine.model_config.vocab_size)
    want = [w[:max_tokens] for w in hf(tiny_llama, prompts)]
    assert engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0)) == want
    all_blocks_back(engine)


def test_stop_ids_and_eos_end_mid_verification(tiny_llama, llama_echo, tmp_path):
    engine = make_engine(tiny_llama, spec=eagle_spec(llama_echo))
    prompts = prompts_for(engine.model_config.vocab_size)
    want = hf(tiny_llama, prompts)
    for p, w in zip(prompts, want):
        stop = w[21]
        sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop])
        assert engine.generate([p], sp) == [w[: w.index(stop) + 1]]
    all_blocks_back(engine)
    model = tmp_path / "eos-model"  # EOS set to a token the greedy loop emits
    shutil.copytree(tiny_llama, model)
    for name in ("config.json", "generation_config.json"):
        f = model / name
        cfg = json.loads(f.read_text())
        cfg["eos_token_id"] = want[-2][10]
        f.write_text(json.dumps(cfg))
    head = echo_head(model, tmp_path / "eos-head", 0.5)
    engine = make_engine(model, spec=eagle_spec(head))
    want = hf(model, prompts)
    assert any(len(w) < MAX_NEW for w in want)
    assert engine.generate(prompts, GREEDY) == want
    all_blocks_back(engine)


def test_aborts_give_every_block_back(tiny_llama, llama_echo):
    engine = make_engine(tiny_llama, spec=eagle_spec(llama_echo))
    prompts = prompts_for(engine.model_config.vocab_size)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(6):
        engine.step()
    assert runner(engine).states and engine.speculator is not None and engine.speculator.stats.num_drafts > 0
    for i in range(len(prompts)):
        engine.abort(f"r{i}")
    engine.step()  # (the speculator drops what it holds for sequences no longer running)
    all_blocks_back(engine)


def test_make_model_cli_writes_a_loadable_head(tiny_qwen2, tmp_path):
    out = tmp_path / "head"
    assert make_model_main(["--eagle-for", str(tiny_qwen2), "--out", str(out)]) == 0
    names = set(load_file(out / "model.safetensors"))
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert "layers.0.input_layernorm.weight" not in names and "embed_tokens.weight" not in names
    engine = make_engine(tiny_qwen2, spec=eagle_spec(out))
    assert runner(engine).head.embed_tokens is None  # the target's embedding is shared


def test_a_head_with_its_own_embedding_matches_hf(tiny_llama, tmp_path):
    head = make_eagle_head(tiny_llama, tmp_path / "head", seed=2, own_embedding=True)
    engine = make_engine(tiny_llama, spec=eagle_spec(head))
    assert runner(engine).head.embed_tokens is not None
    prompts = prompts_for(engine.model_config.vocab_size)[:3]
    assert engine.generate(prompts, GREEDY) == hf(tiny_llama, prompts)
    all_blocks_back(engine)


def test_hidden_rows_by_position():
    rows = HiddenRows(5, torch.arange(4.0)[:, None])  # positions 5..8
    rows.add(9, torch.tensor([[9.0]]))
    rows.add(7, torch.tensor([[70.0], [80.0], [90.0]]))  # 7.. recomputed: 7, 8, 9 replaced
    assert (rows.start, rows.end) == (5, 10)
    assert rows.rows(5, 10)[:, 0].tolist() == [0.0, 1.0, 70.0, 80.0, 90.0]
    rows.drop_before(7)
    assert rows.start == 7 and rows.rows(8, 10)[:, 0].tolist() == [80.0, 90.0]


def test_bad_heads_are_refused(tiny_llama, tmp_path):
    head = make_eagle_head(tiny_llama, tmp_path / "head")
    tensors = load_file(head / "model.safetensors")
    save_file({**tensors, "layers.0.extra.weight": tensors["fc.weight"].clone()}, str(head / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="unexpected"):
        make_engine(tiny_llama, spec=eagle_spec(head))
    save_file({k: v for k, v in tensors.items() if k != "fc.weight"}, str(head / "model.safetensors"))
    with pytest.raises(WeightLoadError, match="missing"):
        make_engine(tiny_llama, spec=eagle_spec(head))
    cfg = json.loads((head / "config.json").read_text())
    (head / "config.json").write_text(json.dumps({**cfg, "hidden_size": 2 * cfg["hidden_size"]}))
    with pytest.raises(ValueError, match="hidden size"):
        make_engine(tiny_llama, spec=eagle_spec(head))


def test_a_proposal_repeated_without_a_step_between_is_the_same(tiny_llama, llama_echo):
    """Drafts dropped before a step (the scheduler left the sequence out): the next proposal
    re-feeds the head's last entry and proposes the same, as the reference does."""
    engine = make_engine(tiny_llama, spec=eagle_spec(llama_echo))
    prompt = prompts_for(engine.model_config.vocab_size)[1]
    seq = engine.add_request("r", prompt, GREEDY)
    for _ in range(3):
        engine.step()
    head = runner(engine)
    base = head.states[id(seq)].base
    tokens = list(seq.token_ids)
    want = reference_proposal(tiny_llama, llama_echo, tokens, base, 3)
    assert head.propose([(seq, 3)]) == [want]
    assert head.propose([(seq, 3)]) == [want]
    engine.abort("r")
    engine.step()
    all_blocks_back(engine)
