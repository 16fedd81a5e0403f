"""N-gram speculation in the engine (engine/spec/): greedy output equals HF transformers token for
token (fp32) on two families, also when a request ends mid-verification (max_tokens, a stop
token id, EOS) or is preempted; every block comes back; the prefix cache never registers a block
holding a rejected draft. Each test also checks drafts were proposed, accepted and rejected,
so it exercises speculation rather than plain decoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.prefix_cache import BlockHasher
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts

MAX_NEW = 40
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=1, disable_by_batch_size=16)


def make_engine(model: Path, spec: SpeculativeConfig | None = SPEC, **kw) -> LLMEngine:
    cache = CacheConfig(block_size=kw.pop("block_size", 4), num_blocks=kw.pop("num_blocks", 256))
    sched = SchedulerConfig(
        max_num_seqs=kw.pop("max_num_seqs", 16),
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 512),
        max_model_len=kw.pop("max_model_len", 256),
    )
    seed = kw.pop("seed", None)
    assert not kw, kw
    cfg = EngineConfig(model=str(model), dtype="float32", cache=cache, scheduler=sched, speculative=spec, seed=seed)
    return LLMEngine(cfg, show_progress=False)


def prompts_for(vocab: int) -> list[list[int]]:
    """Random prompts, and prompts that repeat a phrase (the n-gram lookup finds it)."""
    rnd = random_prompts(vocab, [5, 17, 33, 3], seed=7)
    phrase = random_prompts(vocab, [6], seed=8)[0]
    return rnd + [phrase * 3 + phrase[:2], rnd[1][:4] + phrase + rnd[2][:5] + phrase]


def hf(model: Path, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    return [hf_greedy(str(model), tuple(p), max_new) for p in prompts]


def assert_speculated(engine: LLMEngine) -> None:
    """Drafts were verified, some accepted and some rejected (both paths ran)."""
    assert engine.speculator is not None
    st = engine.speculator.stats
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens, st


def registered_hashes_are_real(engine: LLMEngine, sequences: list[list[int]]) -> None:
    """Every block the prefix cache holds names a prefix of a sequence's real tokens."""
    assert engine.hasher is not None
    hasher: BlockHasher = engine.hasher
    real: set[bytes] = set()
    for tokens in sequences:
        seq = Sequence("check", list(tokens), len(tokens), GREEDY)
        real.update(hasher.extend(seq, len(tokens) // engine.block_size))
    held = engine.pool.hashes()
    assert held, "nothing was cached: the check would prove nothing"
    assert set(held) <= real, f"{len(set(held) - real)} cached blocks hold tokens no sequence has"


def test_greedy_matches_hf_in_a_batch_and_one_at_a_time(tiny_model):
    engine = make_engine(tiny_model)
    prompts = prompts_for(engine.model_config.vocab_size)
    want = hf(tiny_model, prompts)
    assert engine.generate(prompts, GREEDY) == want
    for p, w in zip(prompts, want):
        assert engine.generate([p], GREEDY) == [w]
    assert_speculated(engine)
    engine.pool.assert_all_free()
    registered_hashes_are_real(engine, [p + w for p, w in zip(prompts, want)])


def test_prefix_cache_reuse_after_speculation_stays_exact(tiny_model):
    """Cached blocks that hold generated tokens are reused by prompts that continue them: had a
    block kept a rejected draft's KV, these outputs would differ from HF's."""
    engine = make_engine(tiny_model)
    prompts = prompts_for(engine.model_config.vocab_size)
    first = engine.generate(prompts, GREEDY)
    follow = [p + out + p[:3] for p, out in zip(prompts, first)]
    hits = engine.scheduler.prefix_hit_tokens
    assert engine.generate(follow, GREEDY) == hf(tiny_model, follow)
    assert engine.scheduler.prefix_hit_tokens - hits >= sum(len(p) for p in prompts) // 2
    assert_speculated(engine)
    engine.pool.assert_all_free()


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8, 13])
def test_max_tokens_ends_mid_verification(tiny_llama, max_tokens):
    engine = make_engine(tiny_llama)
    prompts = prompts_for(engine.model_config.vocab_size)
    want = [w[:max_tokens] for w in hf(tiny_llama, prompts)]
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    assert engine.generate(prompts, sp) == want
    engine.pool.assert_all_free()


def test_stop_token_id_ends_mid_verification(tiny_llama):
    engine = make_engine(tiny_llama)
    prompts = prompts_for(engine.model_config.vocab_size)
    want = hf(tiny_llama, prompts)
    outputs = []
    for p, w in zip(prompts, want):
        stop = w[25]  # a token the output holds: it ends there (its first occurrence), inclusive
        sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, stop_token_ids=[stop])
        outputs.append(engine.generate([p], sp)[0])
        assert outputs[-1] == w[: w.index(stop) + 1]
    assert_speculated(engine)
    engine.pool.assert_all_free()


def test_eos_ends_mid_verification(tiny_llama, tmp_path):
    """The model's EOS id set to a token its greedy loop repeats: HF and the engine both stop
    at its first occurrence, which speculation reaches inside a verified run of drafts."""
    probe = make_engine(tiny_llama)
    prompts = prompts_for(probe.model_config.vocab_size)
    outs = hf(tiny_llama, prompts)
    eos = outs[-2][10]
    model = tmp_path / "eos-model"
    shutil.copytree(tiny_llama, model)
    for name in ("config.json", "generation_config.json"):
        f = model / name
        if f.exists():
            cfg = json.loads(f.read_text())
            cfg["eos_token_id"] = eos
            f.write_text(json.dumps(cfg))
    engine = make_engine(model)
    want = hf(model, prompts)
    assert any(len(w) < MAX_NEW for w in want), "EOS was meant to end some outputs early"
    assert engine.generate(prompts, GREEDY) == want
    assert_speculated(engine)
    engine.pool.assert_all_free()


def test_preemption_keeps_output_exact(tiny_model):
    """44 blocks of 4 tokens for ~340 tokens of work: sequences are preempted (drafts and all)
    and recomputed, and verification never preempts anyone for its drafts."""
    engine = make_engine(tiny_model, num_blocks=44, max_num_batched_tokens=64, max_model_len=96)
    prompts = prompts_for(engine.model_config.vocab_size)
    assert engine.generate(prompts, GREEDY) == hf(tiny_model, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert_speculated(engine)
    engine.pool.assert_all_free()


def test_step_budget_trims_drafts(tiny_llama):
    """A 3-token step budget: a verification chunk holds at most the last token + 2 drafts, and
    with two sequences decoding, fewer; prompts are prefilled in chunks beside them."""
    engine = make_engine(tiny_llama, max_num_batched_tokens=3)
    prompts = prompts_for(engine.model_config.vocab_size)[-2:]
    assert engine.generate(prompts, GREEDY) == hf(tiny_llama, prompts)
    assert engine.speculator is not None
    st = engine.speculator.stats
    assert st.num_accepted_tokens > 0 and st.accepted_per_pos[2:] == [0, 0]
    engine.pool.assert_all_free()


def test_large_batch_does_not_speculate(tiny_llama):
    engine = make_engine(tiny_llama, spec=SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=2))
    prompts = prompts_for(engine.model_config.vocab_size)
    assert engine.generate(prompts, GREEDY) == hf(tiny_llama, prompts)
    assert engine.speculator is not None
    # 6 sequences decode together; only once 2 or fewer are left could it speculate
    st = engine.speculator.stats
    assert st.num_draft_tokens < sum(MAX_NEW for _ in prompts) // 2


def test_groups_do_not_speculate_and_stay_exact(tiny_llama):
    """n > 1 (and beams) never speculate: members share blocks copy-on-write."""
    engine = make_engine(tiny_llama)
    prompts = prompts_for(engine.model_config.vocab_size)[-2:]
    sp = SamplingParams(max_tokens=12, temperature=0.0, n=2)
    choices = engine.generate_choices(prompts, sp)
    assert choices == [[w, w] for w in hf(tiny_llama, prompts, 12)]
    assert engine.speculator is not None and engine.speculator.stats.num_drafts == 0
    engine.pool.assert_all_free()


def test_counters_travel_in_worker_heartbeats(tiny_llama):
    """vLLM's spec-decode counters, as decode and colocated workers put them in WorkerStats."""
    import msgspec

    from pdserve.protocol.messages import WorkerStats
    from pdserve.runtime.worker_runtime import engine_stats

    engine = make_engine(tiny_llama)
    engine.generate(prompts_for(engine.model_config.vocab_size)[-2:], GREEDY)
    assert engine.speculator is not None
    st = engine.speculator.stats
    assert st.num_accepted_tokens == sum(st.accepted_per_pos) and st.accepted_per_pos[0] >= st.accepted_per_pos[-1]
    stats = engine.stats()
    assert stats.speculation == engine.speculator.worker_stats()
    sent = engine_stats(stats, 0.0, 0, **stats.speculation)
    got = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=WorkerStats)
    assert (got.spec_num_drafts, got.spec_num_draft_tokens, got.spec_num_accepted_tokens) == (
        st.num_drafts,
        st.num_draft_tokens,
        st.num_accepted_tokens,
    )
    assert got.spec_accepted_per_pos == st.accepted_per_pos and st.num_drafts > 0


@pytest.mark.parametrize("measure_payoff", [True, False])
def test_measure_payoff_off_speculates_where_the_measured_choice_says_no(tiny_llama, measure_payoff):
    spec = SpeculativeConfig.from_json(
        json.dumps({"method": "ngram", "num_speculative_tokens": 4, "measure_payoff": measure_payoff})
    )
    engine = make_engine(tiny_llama, spec=spec)
    assert engine.speculator is not None
    engine.speculator.payoff.allow = lambda n: False  # type: ignore[method-assign]  # "never pays", measured
    prompts = prompts_for(engine.model_config.vocab_size)
    assert engine.generate(prompts, GREEDY) == hf(tiny_llama, prompts)
    assert (engine.speculator.stats.num_drafts > 0) == (not measure_payoff)
    engine.pool.assert_all_free()


def test_measure_payoff_must_be_a_bool():
    with pytest.raises(ValueError, match="measure_payoff must be true or false"):
        SpeculativeConfig.from_json('{"num_speculative_tokens": 4, "measure_payoff": 1}')
