"""n, best_of and beam search as sequence groups: one prefill, shared blocks, copy-on-write,
HF-equal beams, and every block back after the group ends or is aborted."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.llm_engine import PREFILLED, LLMEngine
from pdserve.protocol.sampling import SamplingParams
from tests.conftest import hf_beams, random_prompts
from tests.engine.test_engine_vs_hf import make_engine


def beam_params(width: int, n: int, max_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, n=n, best_of=width, use_beam_search=True, **kw)


def run_group(engine: LLMEngine, rid: str, prompt: list[int], sp: SamplingParams) -> list[list[int]]:
    engine.add_request(rid, prompt, sp)
    out: list[list[int]] = [[] for _ in range(sp.n)]
    while engine.has_work():
        for o in engine.step():
            out[o.seq_index] += o.new_token_ids
        engine.pool.check_integrity()
    return out


@pytest.mark.parametrize(
    "width,n,kw",
    [
        (2, 2, {}),
        (4, 2, {}),
        (8, 3, {}),
        (4, 4, {"length_penalty": 0.5, "early_stopping": True}),
        (3, 2, {"length_penalty": 2.0, "early_stopping": "never", "min_tokens": 4}),
    ],
)
def test_beam_search_equals_hf(tiny_model, width, n, kw):
    # 4-token blocks: the prompt's last block is shared and copied on write, beams fork across blocks
    engine = make_engine(tiny_model, block_size=4, num_blocks=256)
    prompt = random_prompts(engine.model_config.vocab_size, [19], seed=width)[0]
    sp = beam_params(width, n, **kw)
    got = run_group(engine, "b", prompt, sp)
    hf_kw = {k: v for k, v in kw.items() if k != "min_tokens"}
    want = hf_beams(str(tiny_model), tuple(prompt), sp.max_tokens, width, n, min_new_tokens=sp.min_tokens, **hf_kw)
    assert got == want
    engine.pool.assert_all_free()


def test_beam_search_disaggregated_equals_hf(tiny_llama):
    """P prefills the root and sends the first beam candidates; D forks from them."""
    prefill = make_engine(tiny_llama, block_size=4, num_blocks=256)
    decode = make_engine(tiny_llama, block_size=4, num_blocks=256)
    prompt = random_prompts(prefill.model_config.vocab_size, [22], seed=5)[0]
    sp = beam_params(4, 2, max_tokens=12)
    prefill.add_request("b", prompt, sp, prefill_only=True)
    sched = prefill.schedule()
    src = list(sched.chunks[0].seq.block_table)
    (o,) = prefill.execute(sched)
    assert o.finish_reason == PREFILLED and o.request_done and o.fork
    prefill.pool.assert_all_free()
    dst = decode.pool.allocate(len(src))
    decode.kv_cache[:, :, dst] = prefill.kv_cache[:, :, src]  # [L, 2, n, bs, H, D]
    assert decode.add_prefilled("b", prompt, 0, None, sp, dst, fork=o.fork) == []
    got: list[list[int]] = [[], []]
    while decode.has_work():
        for out in decode.step():
            got[out.seq_index] += out.new_token_ids
    assert got == hf_beams(str(tiny_llama), tuple(prompt), 12, 4, 2)
    decode.pool.assert_all_free()


def test_n_sampled_choices_share_the_prompt_blocks(tiny_llama):
    """n = 8 of a 1000-token prompt use at most 1.2x the blocks of one choice (pool's count)."""
    prompt = random_prompts(256, [1000], seed=1)[0]

    def peak_blocks(n: int) -> int:
        engine = make_engine(tiny_llama, block_size=16, num_blocks=200, max_model_len=1024, max_num_batched_tokens=1024)
        engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=n))
        peak = 0
        while engine.has_work():
            engine.step()
            peak = max(peak, engine.pool.num_used)
        engine.pool.assert_all_free()
        return peak

    one, eight = peak_blocks(1), peak_blocks(8)
    assert one >= 63  # 1000 prompt tokens / 16
    assert eight <= 1.2 * one, (one, eight)


def test_copy_on_write_never_changes_another_members_kv(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=128)
    prompt = random_prompts(engine.model_config.vocab_size, [14], seed=2)[0]  # last block: 2 of 4 slots
    engine.add_request("r", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=9, n=4))
    engine.step()  # the prefill: the root forks into 4 members sharing all 4 blocks
    group = engine.seqs["r"].group
    assert group is not None and len(group.live) == 4
    shared = group.live[0].block_table
    assert all(m.block_table == shared for m in group.live)
    assert all(engine.pool.ref_count(b) == 4 for b in shared)

    def prompt_kv(seq) -> torch.Tensor:  # [L, 2, 14, Hkv, D] of the prompt's positions
        kv = engine.kv_cache[:, :, seq.block_table[:4]].flatten(2, 3)
        return kv[:, :, :14].clone()

    before = prompt_kv(group.live[0])
    sched = engine.schedule()
    assert len(sched.block_copies) == 3  # three members copy the shared last block, one keeps it
    engine.execute(sched)
    for _ in range(3):
        engine.step()
    tables = [m.block_table[:4] for m in group.live]
    assert all(t[:3] == shared[:3] for t in tables)  # full blocks stay shared
    assert len({t[3] for t in tables}) == 4  # each member writes its own last block
    for m in group.live:
        assert torch.equal(prompt_kv(m), before)  # bit-equal: nobody's write reached another
    engine.abort("r")
    engine.pool.assert_all_free()


def test_seeded_n_equals_independent_requests(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = random_prompts(engine.model_config.vocab_size, [9], seed=4)[0]
    sp = SamplingParams(max_tokens=10, temperature=2.0, top_k=50, seed=77)
    group = run_group(engine, "g", prompt, SamplingParams(**{**_fields(sp), "n": 3}))
    alone = [engine.generate([prompt], SamplingParams(**{**_fields(sp), "seed": 77 + i}))[0] for i in range(3)]
    assert group == alone
    assert len({tuple(c) for c in group}) == 3
    engine.pool.assert_all_free()


def test_a_stopped_member_gives_its_blocks_back_and_the_others_run_on(tiny_llama):
    """stop_member (a stop string matched at the gateway): that member ends at once, its own
    blocks go back while the others still share the prompt's, and their tokens do not change."""
    engine = make_engine(tiny_llama, block_size=4, num_blocks=256)
    prompt = random_prompts(engine.model_config.vocab_size, [13], seed=9)[0]
    sp = SamplingParams(max_tokens=24, temperature=1.0, seed=11, n=3)
    want = run_group(engine, "w", prompt, sp)
    engine.add_request("g", prompt, sp)
    got: list[list[int]] = [[], [], []]
    for _ in range(6):  # the prompt and 5 decode steps: member 1 holds blocks of its own by now
        for o in engine.step():
            got[o.seq_index] += o.new_token_ids
    used = engine.pool.num_used
    out = engine.stop_member("g", 1)
    assert out is not None and (out.finish_reason, out.seq_index, out.request_done) == ("stop", 1, False)
    assert out.new_token_ids == [] and out.seq.num_output_tokens == len(got[1])
    assert engine.pool.num_used < used  # its own tail blocks, not the shared prompt's
    engine.pool.check_integrity()
    assert engine.stop_member("g", 1) is None  # once
    while engine.has_work():
        for o in engine.step():
            assert o.seq_index != 1
            got[o.seq_index] += o.new_token_ids
    assert got[0] == want[0] and got[2] == want[2] and got[1] == want[1][: len(got[1])]
    engine.pool.assert_all_free()

    # choices that return whole (best_of > n) or a group not forked yet: nothing to stop
    engine.add_request("b", prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=1, n=1, best_of=3))
    assert engine.stop_member("b", 0) is None
    engine.step()
    assert engine.stop_member("b", 0) is None
    assert engine.abort("b")
    engine.pool.assert_all_free()


def _fields(sp: SamplingParams) -> dict:
    return {f: getattr(sp, f) for f in sp.__struct_fields__}


def test_best_of_returns_the_n_with_highest_cumulative_logprob(tiny_llama):
    engine = make_engine(tiny_llama)
    prompt = random_prompts(engine.model_config.vocab_size, [11], seed=6)[0]
    base = SamplingParams(max_tokens=8, temperature=1.0, seed=5, logprobs=0)
    engine.add_request("all", prompt, SamplingParams(**{**_fields(base), "n": 5}))
    tokens: list[list[int]] = [[] for _ in range(5)]
    score = [0.0] * 5
    while engine.has_work():
        for o in engine.step():
            tokens[o.seq_index] += o.new_token_ids
            score[o.seq_index] += sum(lp.logprob for lp in o.logprobs or [])
    ranked = sorted(range(5), key=lambda i: -score[i])[:2]

    engine.add_request("best", prompt, SamplingParams(**{**_fields(base), "n": 2, "best_of": 5, "logprobs": None}))
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert [o.seq_index for o in outs] == [0, 1] and [o.request_done for o in outs] == [False, True]
    assert [o.new_token_ids for o in outs] == [tokens[i] for i in ranked]
    assert all(o.logprobs is None for o in outs)  # computed to rank, not asked for
    engine.pool.assert_all_free()


def test_groups_survive_preemption_and_aborts(tiny_llama):
    """A pool too small for everything: members and whole beam groups are preempted and
    recomputed with unchanged output; aborting groups mid-stream gives every block back."""
    prompts = random_prompts(256, [21, 30, 17], seed=8)
    beam = beam_params(4, 2, max_tokens=12)
    sampled = SamplingParams(max_tokens=14, temperature=1.0, seed=3, n=3)
    roomy = make_engine(tiny_llama, block_size=4, num_blocks=512)
    want = [run_group(roomy, f"w{i}", p, beam if i != 1 else sampled) for i, p in enumerate(prompts)]

    tight = make_engine(tiny_llama, block_size=4, num_blocks=48, max_model_len=64)
    got: dict[str, list[list[int]]] = {}
    for i, p in enumerate(prompts):
        sp = beam if i != 1 else sampled
        tight.add_request(f"r{i}", p, sp)
        got[f"r{i}"] = [[] for _ in range(sp.n)]
    tight.add_request("gone", prompts[0], sampled)  # aborted mid-stream below
    preempted = 0
    steps = 0
    while tight.has_work():
        sched = tight.schedule()
        preempted += len(sched.preempted)
        for o in tight.execute(sched):
            if o.request_id in got:
                got[o.request_id][o.seq_index] += o.new_token_ids
        steps += 1
        if steps == 6:
            assert tight.abort("gone")
        tight.pool.check_integrity()
    assert preempted > 0, "the pool was meant to be small enough to force preemption"
    assert [got[f"r{i}"] for i in range(3)] == want
    tight.pool.assert_all_free()


def test_refuses_a_group_that_cannot_fit(tiny_llama):
    engine = make_engine(tiny_llama, block_size=4, num_blocks=40, max_model_len=128)
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("r", [1, 2, 3], SamplingParams(max_tokens=64, n=8))


@pytest.mark.parametrize("num_blocks", [34, 40])
def test_beam_and_sampled_groups_in_a_tight_pool_finish_exactly(tiny_llama, num_blocks):
    """Several beam groups and sampled groups competing for a pool that holds about two of
    them: preempted beam groups come back whole (no group half running, half waiting for the
    blocks the other half holds), nothing deadlocks, and every output equals a roomy pool's."""
    beam = beam_params(4, 2, max_tokens=12)
    sampled = SamplingParams(max_tokens=14, temperature=1.0, seed=3, n=3)

    def outputs(blocks: int) -> tuple[dict, int]:
        engine = make_engine(tiny_llama, block_size=4, num_blocks=blocks, max_model_len=64, max_num_seqs=12)
        got: dict[str, list[list[int]]] = {}
        for i, p in enumerate(random_prompts(256, [21, 30, 17, 25, 9], seed=1)):
            sp = beam if i % 2 == 0 else sampled
            engine.add_request(f"r{i}", p, sp)
            got[f"r{i}"] = [[] for _ in range(sp.n)]
        preempted, steps = 0, 0
        while engine.has_work():
            sched = engine.schedule()
            preempted += len(sched.preempted)
            for o in engine.execute(sched):
                got[o.request_id][o.seq_index] += o.new_token_ids
            engine.pool.check_integrity()
            steps += 1
            assert steps < 1000, "stuck"
        engine.pool.assert_all_free()
        return got, preempted

    tight, preempted = outputs(num_blocks)
    assert preempted > 0
    assert tight == outputs(512)[0]
