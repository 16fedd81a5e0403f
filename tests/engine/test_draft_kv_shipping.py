"""A draft model's KV built by a prefill engine and handed to a decode engine with the target's
(engine/spec/draft_model.py): one block pool and one memory budget for both models' layers, the
prefill step reports the draft's layers after the target's, and a decode engine given the
shipped draft KV never rebuilds it, yet every proposal is exactly the draft model's own greedy
continuation (HF, from scratch) and the output equals HF's; with the decode side's prefix cache
hit, and without shipped draft KV (rebuilt). The transfer itself is copied here block by block
(the wire is tests/kvtransfer/ and tests/e2e/test_draft_kv_shipped.py)."""

from __future__ import annotations

import torch

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.kv_cache import KVCacheSpec
from pdserve.engine.llm_engine import PREFILLED, LLMEngine
from pdserve.engine.spec.draft_model import DraftRunner
from pdserve.protocol.sampling import SamplingParams
from tests.engine.test_speculation import GREEDY, hf, make_engine, prompts_for
from tests.engine.test_speculation_draft import draft_reference, draft_spec, noisy_copy


def prefill(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[int, list[int], list[int]]:
    """Prefill `prompt` alone on a prefill-only engine: (first token, its blocks, layers the
    step reported stored, in order)."""
    engine.add_request(rid, prompt, GREEDY, prefill_only=True)
    blocks: list[int] = []
    layers: list[int] = []

    def stored(layer: int) -> None:
        if not blocks:
            blocks.extend(engine.seqs[rid].block_table)
        layers.append(layer)

    outs = engine.step(on_layer_stored=stored)
    assert [o.finish_reason for o in outs] == [PREFILLED] and not engine.has_work()
    return outs[0].new_token_ids[0], blocks, layers


def copy_kv(src: LLMEngine, src_blocks: list[int], dst: LLMEngine, dst_blocks: list[int], draft: bool) -> None:
    """What a transfer lands: the target's layers of the blocks, and the draft's when shipped."""
    s, d = torch.tensor(src_blocks), torch.tensor(dst_blocks)
    dst.kv_cache[:, :, d] = src.kv_cache[:, :, s]  # [L, 2, n, bs, Hkv, D]
    if draft:
        assert src.draft is not None and dst.draft is not None
        dst.draft.kv_cache[:, :, d] = src.draft.kv_cache[:, :, s]  # [Ld, 2, n, bs, Hkv', D']


def record_proposals(runner: DraftRunner) -> list[tuple[list[int], int, list[int]]]:
    seen: list[tuple[list[int], int, list[int]]] = []
    propose = runner.propose

    def recording(wants):
        got = propose(wants)
        seen.extend((list(seq.token_ids), k, d) for (seq, k), d in zip(wants, got))
        return got

    runner.propose = recording  # type: ignore[method-assign]
    return seen


def hand_over(p: LLMEngine, d: LLMEngine, rid: str, prompt: list[int], ship_draft: bool) -> None:
    """P prefills; D leases blocks after the prefix it holds (as decode_node/worker.py does),
    receives the rest of the KV and admits the sequence."""
    first, p_blocks, _ = prefill(p, rid, prompt)
    assert d.hasher is not None
    held = d.pool.lookup(d.hasher.hashes(prompt, (len(prompt) - 1) // d.block_size))
    d.pool.acquire(held)
    need = -(-len(prompt) // d.block_size) - len(held)
    leased = d.pool.allocate(need, after=held[-1] if held else None)
    copy_kv(p, p_blocks[len(held) :], d, leased, ship_draft)
    outs = d.add_prefilled(
        rid, prompt, first, None, GREEDY, held + leased, draft_kv_blocks=len(leased) if ship_draft else 0
    )
    assert outs == []


def run_to_end(d: LLMEngine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while d.has_work():
        for o in d.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return got


def test_the_kv_budget_pays_for_the_draft_layers(tiny_llama, tmp_path):
    small = noisy_copy(tiny_llama, tmp_path / "noisy", 0.5)
    budget = 3 << 20

    def engine(spec) -> LLMEngine:
        cache = CacheConfig(block_size=4, memory_bytes=budget)
        sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=128)
        cfg = EngineConfig(model=str(tiny_llama), dtype="float32", cache=cache, scheduler=sched, speculative=spec)
        return LLMEngine(cfg, show_progress=False)

    plain, with_draft = engine(None), engine(draft_spec(small))
    assert with_draft.draft is not None
    target, draft = plain.kv_spec.bytes_per_block, with_draft.draft.kv_spec.bytes_per_block
    assert plain.pool.num_blocks == budget // target
    assert with_draft.pool.num_blocks == budget // (target + draft) < plain.pool.num_blocks
    n = with_draft.pool.num_blocks
    assert with_draft.kv_cache.shape[2] == with_draft.draft.kv_cache.shape[2] == n  # one block id, both pools
    used = with_draft.kv_cache.nbytes + with_draft.draft.kv_cache.nbytes
    assert used == n * (target + draft) <= budget


def test_shipped_draft_kv_is_the_drafts_own_and_never_rebuilt(tiny_llama, tmp_path):
    draft = noisy_copy(tiny_llama, tmp_path / "noisy", 0.5)
    p = make_engine(tiny_llama, spec=draft_spec(draft))
    d = make_engine(tiny_llama, spec=draft_spec(draft))
    assert p.draft is not None and d.draft is not None
    seen = record_proposals(d.draft)
    prompts = prompts_for(p.model_config.vocab_size)
    # the prefill step reports the target's layers, then the draft's after them (their wire numbers)
    _, _, layers = prefill(p, "probe", prompts[0])
    num_target, num_draft = p.model_config.num_layers, d.draft.kv_cache.shape[0]
    assert layers == list(range(num_target, num_target + num_draft)) + list(range(num_target))
    for i, prompt in enumerate(prompts):
        hand_over(p, d, f"r{i}", prompt, ship_draft=True)
    got = run_to_end(d)
    assert [got[f"r{i}"] for i in range(len(prompts))] == [w[1:] for w in hf(tiny_llama, prompts)]
    counts = d.draft.counts
    # the last prompt starts with the second's first block: D held it (its draft KV too)
    assert counts.rebuilt == 0 and counts.cached == 4 and counts.shipped == sum(map(len, prompts)) - 4, counts
    made = [(t, k, drafts) for t, k, drafts in seen if drafts]
    assert len(made) > 20
    for tokens, k, drafts in made:
        assert drafts == draft_reference(draft, tokens, k)
    d.pool.assert_all_free()
    p.pool.assert_all_free()
    assert not d.draft.states


def test_prefix_caches_hold_the_drafts_kv_too(tiny_llama, tmp_path):
    """A repeated prompt: P computes only its last block (its cache holds the rest, the draft's
    KV with it) and D holds its leading blocks (transferred before with the draft's layers):
    the draft's KV of the whole prompt is there, still exact, nothing rebuilt."""
    draft = noisy_copy(tiny_llama, tmp_path / "noisy", 0.5)
    p = make_engine(tiny_llama, spec=draft_spec(draft))
    d = make_engine(tiny_llama, spec=draft_spec(draft))
    assert p.draft is not None and d.draft is not None
    seen = record_proposals(d.draft)
    prompt = prompts_for(p.model_config.vocab_size)[2]  # 33 tokens
    want = hf(tiny_llama, [prompt])[0][1:]
    hand_over(p, d, "first", prompt, ship_draft=True)
    assert run_to_end(d) == {"first": want}
    hits = p.scheduler.prefix_hit_tokens
    hand_over(p, d, "again", prompt, ship_draft=True)
    assert p.scheduler.prefix_hit_tokens - hits == 32  # P: all but the last block from its cache
    assert run_to_end(d) == {"again": want}
    counts = d.draft.counts
    assert counts.rebuilt == 0 and counts.cached == 32 and counts.shipped == 33 + 1, counts
    for tokens, k, drafts in [s for s in seen if s[2]]:
        assert drafts == draft_reference(draft, tokens, k)
    d.pool.assert_all_free()


def test_without_shipped_draft_kv_the_decode_engine_rebuilds_it(tiny_llama, tmp_path):
    """A prefill worker without the draft (or a decode worker's layout without it): the decode
    engine prefills the draft itself at the first proposal; output as exact."""
    draft = noisy_copy(tiny_llama, tmp_path / "noisy", 0.5)
    p = make_engine(tiny_llama, spec=None)
    d = make_engine(tiny_llama, spec=draft_spec(draft))
    assert d.draft is not None
    prompts = prompts_for(p.model_config.vocab_size)
    for i, prompt in enumerate(prompts):
        hand_over(p, d, f"r{i}", prompt, ship_draft=False)
    got = run_to_end(d)
    assert [got[f"r{i}"] for i in range(len(prompts))] == [w[1:] for w in hf(tiny_llama, prompts)]
    counts = d.draft.counts
    assert counts.shipped == 0 and counts.rebuilt == sum(map(len, prompts)), counts
    d.pool.assert_all_free()


def test_draft_kv_spec_is_the_drafts_shape(tiny_llama, tmp_path):
    small = noisy_copy(tiny_llama, tmp_path / "noisy", 0.5)
    e = make_engine(tiny_llama, spec=draft_spec(small))
    assert e.draft is not None
    want = KVCacheSpec.for_model(e.draft.model_config, e.block_size, torch.float32).shape(e.pool.num_blocks)
    assert tuple(e.draft.kv_cache.shape) == want
    assert e.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0)) == hf(tiny_llama, [[1, 2, 3]], 3)
