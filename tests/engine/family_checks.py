"""Greedy output == HF generate (fp32) for a model folder, in the engine modes every family must
pass: a decode batch of several sequences on a warm prefix cache, chunked prefill, and the
prefill -> decode KV hand-off. Shared by the per-family tests (test_qwen3.py, test_phi3.py)."""

from __future__ import annotations

from pathlib import Path

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.llm_engine import PREFILLED, LLMEngine
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


def make_engine(model: Path, **kw) -> LLMEngine:
    cache = CacheConfig(block_size=kw.pop("block_size", 4), num_blocks=kw.pop("num_blocks", 256))
    sched = SchedulerConfig(
        max_num_seqs=kw.pop("max_num_seqs", 16),
        max_num_batched_tokens=kw.pop("max_num_batched_tokens", 512),
        max_model_len=kw.pop("max_model_len", 256),
    )
    activations = kw.pop("activation_quantization", "auto")
    assert not kw, kw
    config = EngineConfig(
        model=str(model), dtype="float32", cache=cache, scheduler=sched, activation_quantization=activations
    )
    return LLMEngine(config, show_progress=False)


def prompts_for(vocab: int) -> list[list[int]]:
    """Mixed lengths; the last two share a 20-token prefix with the first (prefix cache hits)."""
    base = random_prompts(vocab, [5, 17, 33, 24, 3], seed=7)
    return base + [base[2][:20] + base[4], base[2][:20] + base[1][:9]]


def expected(model: Path, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    return [hf_greedy(str(model), tuple(p), max_new) for p in prompts]


def check_batch_with_prefix_cache(model: Path) -> LLMEngine:
    """All prompts in one batch, twice: the second pass reuses the first's cached blocks."""
    engine = make_engine(model)
    prompts = prompts_for(engine.model_config.vocab_size)
    want = expected(model, prompts)
    assert engine.generate(prompts, GREEDY) == want
    hits = engine.scheduler.prefix_hit_tokens
    assert engine.generate(prompts, GREEDY) == want
    assert engine.scheduler.prefix_hit_tokens > hits, "the second pass was meant to hit the prefix cache"
    engine.pool.assert_all_free()
    return engine


def check_chunked_prefill(model: Path) -> None:
    """A 7-token step budget: every prompt but the shortest is prefilled in chunks."""
    engine = make_engine(model, max_num_batched_tokens=7)
    prompts = prompts_for(engine.model_config.vocab_size)
    assert engine.generate(prompts, GREEDY) == expected(model, prompts)
    engine.pool.assert_all_free()


def hand_off(
    prefill: LLMEngine, decode: LLMEngine, prompts: list[list[int]], sampling: SamplingParams = GREEDY
) -> list[list[int]]:
    """P prefills the prompts (as its budget chunks them); each one's blocks are copied into D's
    pool as stored and D decodes it to the end: the outputs in prompt order. Every block of both
    pools comes back."""
    outs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        prefill.add_request(f"r{i}", p, sampling, prefill_only=True)
    while prefill.has_work():
        sched = prefill.schedule()
        tables = {c.seq.request_id: list(c.seq.block_table) for c in sched.chunks}
        for o in prefill.execute(sched):
            assert o.finish_reason in (PREFILLED, "stop")
            src = tables[o.request_id]
            dst = decode.pool.allocate(len(src))
            decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src]  # [L, 2, n, bs, Hkv, W]
            decode.add_prefilled(o.request_id, o.seq.prompt_token_ids, o.new_token_ids[0], None, sampling, dst)
            outs[o.request_id] = list(o.new_token_ids)
    prefill.pool.assert_all_free()
    while decode.has_work():
        for o in decode.step():
            outs[o.request_id] += o.new_token_ids
    decode.pool.assert_all_free()
    return [outs[f"r{i}"] for i in range(len(prompts))]


def check_prefill_to_decode_handoff(model: Path) -> None:
    """Disaggregation at engine level: P prefills (chunked), its blocks are copied into D's pool."""
    prefill = make_engine(model, max_num_batched_tokens=24)
    decode = make_engine(model)
    prompts = prompts_for(prefill.model_config.vocab_size)
    assert hand_off(prefill, decode, prompts) == expected(model, prompts)


def teacher_forced(engine: LLMEngine, prompts: list[list[int]], want: list[list[int]]) -> list[int]:
    """At each position of each reference continuation, the engine's greedy token given the
    reference's prefix (one step past the cached prefix each time), flattened."""
    one = SamplingParams(max_tokens=1, temperature=0.0)
    return [engine.generate([p + w[:k]], one)[0][0] for p, w in zip(prompts, want) for k in range(len(w))]
