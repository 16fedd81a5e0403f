"""The prefix cache: content-addressed blocks, reuse of the longest cached prefix, LRU eviction,
and greedy output that equals HF transformers (and caching off) whatever is reused."""

from __future__ import annotations

import pytest

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.prefix_cache import BlockHasher
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import hf_greedy, random_prompts
from tests.engine.test_engine_vs_hf import make_engine

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)


# --- content addresses ----------------------------------------------------------------------
def test_hashes_chain_over_the_whole_prefix_and_skip_partial_blocks():
    h = BlockHasher("model-a", 4)
    a = h.hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2  # the partial third block has none
    assert h.hashes([1, 2, 3, 4, 5, 6, 7, 8]) == a
    b = h.hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert b[0] != a[0] and b[1] != a[1]  # same second block, different prefix: different identity
    assert BlockHasher("model-b", 4).hashes([1, 2, 3, 4]) != a[:1]  # another model's KV never matches
    assert BlockHasher("model-a", 2).hashes([1, 2, 3, 4])[-1] != a[0]


# --- the pool -------------------------------------------------------------------------------
def test_freed_registered_blocks_stay_cached_until_their_space_is_needed():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    for b, h in zip(blocks, (b"h0", b"h1", b"h2")):
        pool.register(b, h)
    pool.free(blocks[::-1])  # tail first: the prefix is evicted last
    pool.check_integrity()
    assert pool.num_free == 4 and pool.num_cached == 3
    assert pool.lookup([b"h0", b"h1", b"hX", b"h2"]) == blocks[:2]  # the leading run only
    pool.acquire(blocks[:1])
    assert pool.num_free == 3 and pool.ref_count(blocks[0]) == 1
    fresh = pool.allocate(2)  # one empty block, then evicts h2 (least recently freed)
    assert blocks[2] in fresh and pool.lookup([b"h0", b"h1", b"h2"]) == blocks[:2]
    pool.check_integrity()
    pool.allocate(1)  # evicts h1
    assert pool.lookup([b"h0", b"h1"]) == blocks[:1] and pool.num_free == 0
    pool.free(blocks[:1])
    pool.check_integrity()


def test_partial_blocks_and_duplicate_contents_are_never_shared():
    pool = BlockPool(4)
    a, b = pool.allocate(1), pool.allocate(1)
    pool.register(a[0], b"same")
    pool.register(b[0], b"same")  # a second block with the same content stays private
    pool.free(a + b)
    assert pool.num_cached == 1 and pool.lookup([b"same"]) == a
    pool.check_integrity()
    off = BlockPool(2, enable_caching=False)
    c = off.allocate(1)
    off.register(c[0], b"x")
    off.free(c)
    assert off.lookup([b"x"]) == [] and off.num_cached == 0


# --- the engine -----------------------------------------------------------------------------
def run_one(engine, prompt):
    out = engine.generate([prompt], GREEDY)[0]
    engine.pool.check_integrity()
    return out


@pytest.mark.parametrize("shared", [15, 16, 17, 32])  # just before, at and after a block boundary
def test_shared_prefix_is_reused_and_output_is_exact(tiny_model, shared):
    engine = make_engine(tiny_model, block_size=16, num_blocks=64)
    vocab = engine.model_config.vocab_size
    system = random_prompts(vocab, [shared], seed=11)[0]
    tails = random_prompts(vocab, [5, 9, 1], seed=12)
    prompts = [system + t for t in tails] + [list(system)]
    for i, p in enumerate(prompts):
        hit_before = engine.scheduler.prefix_hit_tokens
        assert run_one(engine, p) == hf_greedy(str(tiny_model), tuple(p), MAX_NEW)
        hit = engine.scheduler.prefix_hit_tokens - hit_before
        reusable = min(shared, len(p) - 1) // 16 * 16 if i else 0
        assert hit == reusable, (i, hit, reusable)
    engine.pool.assert_all_free()


def test_a_conversation_reuses_the_previous_turn_including_its_output(tiny_model):
    engine = make_engine(tiny_model, block_size=4, num_blocks=128)
    vocab = engine.model_config.vocab_size
    history = random_prompts(vocab, [10], seed=21)[0]
    computed = 0  # tokens with KV after the previous turn (its last sampled token has none)
    for turn in range(4):
        before = engine.scheduler.prefix_hit_tokens
        out = run_one(engine, history)
        assert out == hf_greedy(str(tiny_model), tuple(history), MAX_NEW)
        assert engine.scheduler.prefix_hit_tokens - before == min(computed, len(history) - 1) // 4 * 4
        computed = len(history) + len(out) - 1
        history = history + out + random_prompts(vocab, [3], seed=30 + turn)[0]
    engine.pool.assert_all_free()


def test_caching_on_equals_caching_off_under_eviction_and_preemption(tiny_model):
    """A pool too small for everything: cached prefixes are evicted, sequences preempted and
    resumed from whatever is still cached; every output equals caching off."""
    vocab = make_engine(tiny_model).model_config.vocab_size
    system = random_prompts(vocab, [24], seed=5)[0]
    prompts = [system + t for t in random_prompts(vocab, [3, 20, 7, 31, 2, 12], seed=6)]
    prompts += random_prompts(vocab, [40, 9], seed=7)
    outs = {}
    for caching in (True, False):
        engine = make_engine(tiny_model, block_size=4, num_blocks=40, max_model_len=160)
        if not caching:
            engine.pool.enable_caching, engine.scheduler.hasher, engine.hasher = False, None, None
        outs[caching] = engine.generate(prompts, GREEDY)
        outs[caching] += engine.generate(prompts[:3], GREEDY)  # again, after the others pushed them out
        engine.pool.assert_all_free()
        if caching:
            assert engine.scheduler.prefix_hit_tokens > 0
    assert outs[True] == outs[False]
    assert outs[True][:1] == [hf_greedy(str(tiny_model), tuple(prompts[0]), MAX_NEW)]


def test_concurrent_identical_prompts(tiny_model):
    engine = make_engine(tiny_model, block_size=4, num_blocks=128)
    p = random_prompts(engine.model_config.vocab_size, [22], seed=9)[0]
    outs = engine.generate([p] * 4, GREEDY)
    assert outs == [hf_greedy(str(tiny_model), tuple(p), MAX_NEW)] * 4
    assert engine.generate([p] * 2, GREEDY) == outs[:2]
    engine.pool.assert_all_free()


def test_an_aborted_request_never_frees_blocks_another_uses(tiny_model):
    engine = make_engine(tiny_model, block_size=4, num_blocks=128, max_num_batched_tokens=8)
    vocab = engine.model_config.vocab_size
    system = random_prompts(vocab, [16], seed=3)[0]
    first = system + [7, 8]
    run_one(engine, first)  # the system prompt is cached now
    a = engine.add_request("a", system + [1, 2, 3], GREEDY)
    b = engine.add_request("b", system + [4, 5, 6, 9, 9, 9, 9, 9, 9, 9], GREEDY)
    engine.step()  # both admitted on the cached prefix, chunks under way
    shared = a.block_table[:4]
    assert shared == b.block_table[:4] and all(engine.pool.ref_count(x) == 2 for x in shared)
    assert engine.abort("a")
    assert all(engine.pool.ref_count(x) == 1 for x in shared)
    out = []
    while engine.has_work():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert out == hf_greedy(str(tiny_model), tuple(b.prompt_token_ids), MAX_NEW)
    engine.pool.assert_all_free()
