"""The engine's one door (engine/engine_core.py), as the workers use it: blocks reserved for a
lease come back exactly once, through `add_prefilled` (admitted, or refused and freed there) or
`release_blocks`; the stats and info the runtime turns into heartbeats and registration."""

from __future__ import annotations

import pytest

from pdserve.engine.engine_core import EngineCore, EngineStats, start_engine
from pdserve.engine.llm_engine import PREFILLED
from pdserve.protocol.sampling import SamplingParams
from pdserve.runtime.worker_runtime import describe_worker, engine_stats
from tests.conftest import random_prompts
from tests.engine.test_engine_vs_hf import make_engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
BS = 4


@pytest.fixture
def engine(tiny_llama):
    return make_engine(tiny_llama, block_size=BS, num_blocks=64)


def prefill_elsewhere(tiny_llama, prompt):
    """A prefill worker's engine: the prompt's first token and its KV, as P ships them."""
    p = make_engine(tiny_llama, block_size=BS, num_blocks=64)
    p.add_request("p", prompt, GREEDY, prefill_only=True)
    sched = p.schedule()
    table = list(sched.prefills[0].seq.block_table)  # (freed once the step ends it)
    (out,) = [o for o in p.execute(sched) if o.finish_reason == PREFILLED]
    return out.new_token_ids[0], p.kv_cache[:, :, table].clone()


def test_the_engine_is_an_engine_core(engine):
    assert isinstance(engine, EngineCore)
    info = engine.info
    assert (info.num_blocks, info.block_size, info.max_model_len) == (64, BS, engine.max_model_len)
    assert info.num_layers == engine.model_config.num_layers and info.draft_num_layers == 0
    wi = describe_worker(info, "decode", "ipc://x", "host")
    assert wi.kv_layout.num_blocks == 64 and wi.model_fingerprint == engine.model_config.fingerprint(engine.dtype)


def test_reserved_blocks_come_back_through_release_blocks(engine):
    free = engine.stats().num_free_blocks
    assert engine.can_reserve(free, []) and not engine.can_reserve(free + 1, [])
    blocks = engine.reserve_blocks(5, [])
    assert len(blocks) == 5 and engine.stats().num_free_blocks == free - 5
    engine.release_blocks(blocks)
    assert engine.stats().num_free_blocks == free
    engine.pool.assert_all_free()


def test_a_lease_admitted_decodes_as_one_engine_would(engine, tiny_llama):
    prompt = random_prompts(engine.model_config.vocab_size, [10], seed=5)[0]
    want = make_engine(tiny_llama, block_size=BS, num_blocks=64).generate([prompt], GREEDY)[0]
    first, kv = prefill_elsewhere(tiny_llama, prompt)
    blocks = engine.reserve_blocks(-(-len(prompt) // BS), [])
    engine.kv_cache[:, :, blocks] = kv  # the transfer
    assert engine.add_prefilled("r", prompt, first, None, GREEDY, blocks) == []
    got = [first]
    while engine.has_work():
        got += [t for o in engine.step() for t in o.new_token_ids]
    assert got == want
    engine.pool.assert_all_free()


@pytest.mark.parametrize("why", ["too long", "duplicate", "wrong prefix"])
def test_a_refused_lease_frees_its_blocks_in_the_engine(engine, why):
    vocab = engine.model_config.vocab_size
    prompt = random_prompts(vocab, [9], seed=6)[0]
    prefix: list[int] = []
    if why == "duplicate":
        engine.add_request("r", prompt, GREEDY)
    if why == "wrong prefix":  # a finished request's cached blocks, offered for another prompt
        other = random_prompts(vocab, [9], seed=7)[0]
        engine.generate([other], GREEDY)
        prefix = engine.cached_prefix(engine.hasher.hashes(other, 2))
        assert len(prefix) == 2
    before = engine.stats()
    blocks = engine.reserve_blocks(3 - len(prefix), prefix)
    if why == "too long":
        prompt = prompt * engine.max_model_len
    with pytest.raises(ValueError):
        engine.add_prefilled("r", prompt, 1, None, GREEDY, prefix + blocks, num_prefix_blocks=len(prefix))
    after = engine.stats()
    assert after.num_free_blocks == before.num_free_blocks
    # the offered prefix is cached again, unowned (a new block taken right after it may have
    # evicted the cached block that followed: BlockPool.allocate(after=...))
    assert after.num_cached_blocks >= len(prefix) and all(engine.pool.ref_count(b) == 0 for b in prefix)
    engine.abort("r")
    engine.pool.assert_all_free()


def test_stats_are_what_heartbeats_carry(engine):
    engine.add_request("a", [1, 2, 3, 4, 5], GREEDY)
    engine.set_max_num_seqs(3)
    st = engine.stats()
    assert isinstance(st, EngineStats) and st.has_work and st.num_waiting == 1 and st.seq_limit == 3
    sent = engine_stats(st, 0.0, 0, extra_waiting=2)
    assert (sent.num_waiting, sent.seq_limit, sent.kv_blocks_total) == (3, 3, 64)
    assert engine.queued_prompt_tokens() == 5 and engine.schedule_prefill(frozenset(), 64).prefills


def test_start_engine_reports_each_layer(tiny_llama):
    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig

    layers = []
    config = EngineConfig(
        model=str(tiny_llama),
        dtype="float32",
        cache=CacheConfig(block_size=BS, num_blocks=32),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64),
    )
    engine = start_engine(config, on_layer_done=lambda: layers.append(1))
    engine.add_request("a", [1, 2, 3], GREEDY)
    engine.step()
    assert len(layers) == engine.info.num_layers
    engine.close()
