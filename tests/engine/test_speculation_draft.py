"""Draft-model speculation in the engine (engine/spec/draft_model.py): greedy output equals HF
transformers token for token (fp32) and the output without speculation, with the target as its
own draft (every draft accepted: the draft's KV bookkeeping is exact), a noisy copy of the target
(some drafts accepted, some rejected: rollback) and a smaller model of another seed; requests
ending mid-verification (max_tokens, stop ids, EOS), preemption, prefix cache on, a draft pool
too small for everyone's drafts; seeded sampling as without speculation; every block of both pools back."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.modelgen.make_model import make_model
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import _hf_model
from tests.engine.test_speculation import GREEDY, MAX_NEW, hf, make_engine, prompts_for, registered_hashes_are_real


def draft_spec(draft: Path, k: int = 4, **kw) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(draft), num_speculative_tokens=k, **kw)


def noisy_copy(model: Path, out: Path, scale: float, seed: int = 0) -> Path:
    """The target's folder with Gaussian noise (`scale` x each tensor's std) on its weights: a
    draft that agrees with the target often but not always."""
    if out.exists():
        return out
    shutil.copytree(model, out)
    gen = torch.Generator().manual_seed(seed)
    for f in out.glob("*.safetensors"):
        tensors = load_file(f)
        for name, t in tensors.items():
            if t.is_floating_point() and t.numel() > 1:
                tensors[name] = t + scale * t.std() * torch.randn(t.shape, generator=gen)
        save_file(tensors, f, metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def noisy_draft(tiny_model, tmp_path_factory) -> Path:
    return noisy_copy(tiny_model, tmp_path_factory.mktemp("drafts") / f"noisy-{tiny_model.name}", 0.5)


def all_blocks_back(engine: LLMEngine) -> None:
    engine.pool.assert_all_free()
    assert engine.speculator is not None and engine.speculator.draft is not None
    draft = engine.speculator.draft
    assert not draft.states, "draft state kept for finished sequences"
    assert draft.pool is engine.pool  # one pool: the draft's KV is in the sequences' own blocks


def stats(engine: LLMEngine):
    assert engine.speculator is not None
    return engine.speculator.stats


def test_target_as_its_own_draft_accepts_every_draft(tiny_model):
    """Same weights, greedy: every draft must be accepted, which holds only if the draft's KV
    always sits exactly on the sequence's accepted tokens (catch-up, self-fed drafts, rollback)."""
    engine = make_engine(tiny_model, spec=draft_spec(tiny_model))
    prompts = prompts_for(engine.model_config.vocab_size)
    want = hf(tiny_model, prompts)
    assert engine.generate(prompts, GREEDY) == want
    st = stats(engine)
    assert st.num_drafts > 0 and st.num_accepted_tokens == st.num_draft_tokens, st
    assert st.accepted_per_pos[3] > 0
    all_blocks_back(engine)


def test_noisy_draft_in_a_batch_with_prefix_cache_matches_hf(tiny_model, noisy_draft):
    engine = make_engine(tiny_model, spec=draft_spec(noisy_draft))
    assert engine.hasher is not None  # prefix cache on
    prompts = prompts_for(engine.model_config.vocab_size)
    want = hf(tiny_model, prompts)
    assert engine.generate(prompts, GREEDY) == want
    st = stats(engine)
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens, st
    registered_hashes_are_real(engine, [p + w for p, w in zip(prompts, want)])
    follow = [p + w + p[:3] for p, w in zip(prompts, want)]  # cached prefixes reused; the draft catches up
    hits = engine.scheduler.prefix_hit_tokens
    assert engine.generate(follow, GREEDY) == hf(tiny_model, follow)
    assert engine.scheduler.prefix_hit_tokens > hits
    all_blocks_back(engine)


def test_smaller_draft_of_another_seed_matches_hf(tiny_llama, tmp_path):
    draft = make_model(tmp_path / "small", preset="tiny", arch="llama", seed=9, num_layers=1, quiet=True)
    engine = make_engine(tiny_llama, spec=draft_spec(draft))
    prompts = prompts_for(engine.model_config.vocab_size)
    assert engine.generate(prompts, GREEDY) == hf(tiny_llama, prompts)
    assert stats(engine).num_drafts > 0
    all_blocks_back(engine)


def draft_reference(draft: Path, tokens: list[int], k: int) -> list[int]:
    """The draft model's own greedy continuation of `tokens` (HF transformers, no KV cache)."""
    model = _hf_model(str(draft))
    seq = list(tokens)
    with torch.no_grad():
        for _ in range(k):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(tokens) :]


def test_every_proposal_is_the_drafts_own_continuation(tiny_llama, tmp_path):
    """The draft's KV bookkeeping checked directly: each proposal (after rejections rolled back,
    preemptions, catch-up chunks) equals the draft model's greedy continuation of the
    sequence's real tokens computed from scratch by HF."""
    draft = noisy_copy(tiny_llama, tmp_path / "noisy", 0.5)
    engine = make_engine(tiny_llama, spec=draft_spec(draft), num_blocks=44, max_num_batched_tokens=64, max_model_len=96)
    assert engine.speculator is not None and engine.speculator.draft is not None
    runner = engine.speculator.draft
    seen: list[tuple[list[int], int, list[int]]] = []
    propose = runner.propose

    def recording(wants):
        got = propose(wants)
        seen.extend((list(seq.token_ids), k, d) for (seq, k), d in zip(wants, got))
        return got

    runner.propose = recording  # type: ignore[method-assign]
    prompts = prompts_for(engine.model_config.vocab_size)
    assert engine.generate(prompts, GREEDY) == hf(tiny_llama, prompts)
    st = stats(engine)
    assert engine.scheduler.num_preemptions > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    made = [(tokens, k, drafts) for tokens, k, drafts in seen if drafts]  # ([]: no room in the draft pool)
    assert len(made) > 20
    for tokens, k, drafts in made:
        assert drafts == draft_reference(draft, tokens, k)
    all_blocks_back(engine)


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 11])
def test_max_tokens_ends_mid_verification(tiny_llama, max_tokens):
    engine = make_engine(tiny_llama, spec=draft_spec(tiny_llama))
    prompts = prompts_for(engine.model_config.vocab_size)
    want = [w[:max_tokens] for w in hf(tiny_llama, prompts)]
    assert engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0)) == want
    all_blocks_back(engine)


def test_stop_ids_and_eos_end_mid_verification(tiny_llama, tmp_path):
    engine = make_engine(tiny_llama, spec=draft_spec(tiny_llama))
    prompts = prompts_for(engine.model_config.vocab_size)
    want = hf(tiny_llama, prompts)
    for p, w in zip(prompts, want):
        stop = w[21]
        sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop])
        assert engine.generate([p], sp) == [w[: w.index(stop) + 1]]
    all_blocks_back(engine)
    # EOS set to a token the greedy loop emits: target and draft (the same folder) stop there
    model = tmp_path / "eos-model"
    shutil.copytree(tiny_llama, model)
    for name in ("config.json", "generation_config.json"):
        f = model / name
        cfg = json.loads(f.read_text())
        cfg["eos_token_id"] = want[-2][10]
        f.write_text(json.dumps(cfg))
    engine = make_engine(model, spec=draft_spec(model))
    want = hf(model, prompts)
    assert any(len(w) < MAX_NEW for w in want)
    assert engine.generate(prompts, GREEDY) == want
    assert stats(engine).num_accepted_tokens > 0
    all_blocks_back(engine)


def test_preemption_keeps_output_exact(tiny_model, noisy_draft):
    engine = make_engine(
        tiny_model, spec=draft_spec(noisy_draft), num_blocks=44, max_num_batched_tokens=64, max_model_len=96
    )
    prompts = prompts_for(engine.model_config.vocab_size)
    assert engine.generate(prompts, GREEDY) == hf(tiny_model, prompts)
    assert engine.scheduler.num_preemptions > 0 and stats(engine).num_accepted_tokens > 0
    all_blocks_back(engine)


def test_sequences_the_pool_cannot_hold_drafts_for_do_not_speculate(tiny_llama):
    """The draft's KV sits in the sequences' own blocks (one pool): in a pool of 30 blocks (120
    tokens) for six sequences of up to ~85 tokens, drafts that find no block are not proposed
    (no preemption for them), and the output stays exact."""
    engine = make_engine(tiny_llama, spec=draft_spec(tiny_llama), num_blocks=30, max_model_len=96)
    prompts = prompts_for(engine.model_config.vocab_size)
    assert engine.generate(prompts, GREEDY) == hf(tiny_llama, prompts)
    st = stats(engine)
    assert 0 < st.num_drafts and st.num_accepted_tokens == st.num_draft_tokens
    all_blocks_back(engine)


def test_aborts_mid_speculation_give_every_block_back(tiny_llama, tmp_path):
    draft = noisy_copy(tiny_llama, tmp_path / "noisy", 0.5)
    engine = make_engine(tiny_llama, spec=draft_spec(draft))
    prompts = prompts_for(engine.model_config.vocab_size)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    for _ in range(6):
        engine.step()
    assert engine.speculator is not None and engine.speculator.draft is not None
    assert engine.speculator.draft.states  # draft KV held
    for i in range(0, len(prompts), 2):
        assert engine.abort(f"r{i}")
    while engine.has_work():
        engine.step()
    assert stats(engine).num_accepted_tokens > 0
    all_blocks_back(engine)


def test_seeded_sampling_equals_no_speculation(tiny_llama):
    """Greedy drafts against sampled targets: some accepted, some not; a seeded request draws the
    very tokens it draws without speculation, with the same logprobs to 1e-3 (a verify step's
    rows go through the few-row GEMM, a plain decode's one row through the one-row kernel: their
    fp32 sums differ in the last bits; on an AVX2 machine one logprob was 1e-4 off)."""
    prompts = prompts_for(512)[:4]  # (the tiny preset's vocabulary)
    sp = [SamplingParams(max_tokens=24, temperature=0.7, seed=100 + i, logprobs=2) for i in range(len(prompts))]
    runs = []
    for spec in (None, draft_spec(tiny_llama)):
        engine = make_engine(tiny_llama, spec=spec)
        for i, (p, s) in enumerate(zip(prompts, sp)):
            engine.add_request(f"r{i}", p, s)
        got: dict[str, list] = {}
        while engine.has_work():
            for o in engine.step():
                got.setdefault(o.request_id, []).extend((lp.token_id, lp.logprob) for lp in o.logprobs or [])
        runs.append(got)
        if spec is not None:
            st = stats(engine)
            assert 0 < st.num_accepted_tokens < st.num_draft_tokens, st
            all_blocks_back(engine)
    assert runs[0].keys() == runs[1].keys() and all(len(v) == 24 for v in runs[0].values())
    for rid, plain in runs[0].items():
        assert [t for t, _ in plain] == [t for t, _ in runs[1][rid]]
        assert max(abs(a - b) for (_, a), (_, b) in zip(plain, runs[1][rid])) < 1e-3


def test_a_draft_with_another_tokenizer_is_refused(tiny_llama, tmp_path):
    other = make_model(tmp_path / "other-vocab", preset="tiny", arch="llama", seed=4, vocab_size=300, quiet=True)
    with pytest.raises(ValueError, match="target's tokenizer"):
        make_engine(tiny_llama, spec=draft_spec(other))


def test_the_flag_parses_vllm_keys():
    want = SpeculativeConfig(method="draft_model", model="/m", num_speculative_tokens=3)
    assert SpeculativeConfig.from_json('{"model": "/m", "num_speculative_tokens": 3}') == want
    assert SpeculativeConfig.from_json('{"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}') == want
    for bad in (
        '{"method": "ngram", "model": "/m", "num_speculative_tokens": 3}',
        '{"method": "draft_model", "num_speculative_tokens": 3}',
        '{"model": 5, "num_speculative_tokens": 3}',
    ):
        with pytest.raises(ValueError, match="model"):
            SpeculativeConfig.from_json(bad)
