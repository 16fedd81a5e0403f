"""Scheduler and block pool as pure logic: no model, no tensors."""

import pytest

from pdserve.engine.block_pool import BlockPool, NoFreeBlocks
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import SeqStatus, Sequence
from pdserve.protocol.sampling import SamplingParams


def make_seq(rid: str, n_prompt: int) -> Sequence:
    return Sequence(rid, list(range(1, n_prompt + 1)), n_prompt, SamplingParams())


def planned(chunks) -> list[tuple[str, int]]:
    """(request id, tokens) of each scheduled chunk, in order."""
    return [(c.seq.request_id, c.num_tokens) for c in chunks]


def run_step(sched: Scheduler, new_token: int = 7):
    """Pretend the model ran: advance computed counts, append a token where one is sampled."""
    out = sched.schedule()
    for c in out.chunks:
        sampled = c.completes_sequence
        c.seq.num_computed_tokens += c.num_tokens
        if sampled:
            c.seq.token_ids.append(new_token)
    return out


def test_block_pool_refcounts_and_integrity():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1
    pool.incref(a[:1])
    pool.free(a)
    assert pool.num_free == 3 and pool.ref_count(a[0]) == 1
    pool.free(a[:1])
    pool.assert_all_free()
    with pytest.raises(NoFreeBlocks):
        pool.allocate(5)
    with pytest.raises(AssertionError):
        pool.free([0])  # double free


def test_block_pool_keeps_sequences_in_runs():
    """New sequences start in the middle of the largest gap; growth continues the run; with no
    run left, any free blocks are handed out."""
    pool = BlockPool(64)
    a = pool.allocate(3)
    assert a == [0, 1, 2]  # the gap at the start has nobody before it
    b = pool.allocate(3)
    assert b[0] > a[-1] + 8  # room left for `a` to grow
    assert pool.allocate(2, after=a[-1]) == [3, 4]  # growth continues a's run
    assert pool.allocate(1, after=b[-1]) == [b[-1] + 1]
    rest = pool.allocate(pool.num_free - 2)
    pool.free(rest[::2])  # fragment the pool: no run of 3 left
    scattered = pool.allocate(3)
    assert len(set(scattered)) == 3 and all(pool.ref_count(x) == 1 for x in scattered)
    pool.check_integrity()


def test_scheduler_grows_sequences_in_runs():
    from pdserve.kernels.metadata import run_start

    pool = BlockPool(64)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6), pool, block_size=4)
    seqs = [make_seq(f"r{i}", 9) for i in range(3)]
    for s in seqs:
        sched.add(s)
    for _ in range(12):  # chunked prefills, then decodes, all interleaved
        run_step(sched)
    assert all(len(s.block_table) >= 4 and run_start(s.block_table) >= 0 for s in seqs)


def test_decode_first_then_prefill_under_budget():
    pool = BlockPool(64)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=10), pool, block_size=4)
    a = make_seq("a", 6)
    s.add(a)
    out = run_step(s)
    assert planned(out.prefills) == [("a", 6)]
    b = make_seq("b", 20)
    s.add(b)
    out = run_step(s)
    # a decodes (1 token) first, b gets the rest of the budget as a chunk
    assert planned(out.decodes) == [("a", 1)]
    assert planned(out.prefills) == [("b", 9)]
    out = run_step(s)
    assert planned(out.chunks) == [("a", 1), ("b", 9)]
    out = run_step(s)  # b's last 2 tokens complete its prompt and sample
    assert planned(out.chunks) == [("a", 1), ("b", 2)]
    assert b.num_output_tokens == 1
    assert len(b.block_table) == -(-b.num_computed_tokens // 4)
    pool.check_integrity()


def test_a_prompts_last_token_left_alone_is_a_prefill_chunk():
    """Chunking that leaves a prompt's last token for a step of its own schedules it as a
    prefill chunk (a prefill worker ships the KV of prefill chunks), not as a decode."""
    pool = BlockPool(64)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8), pool, block_size=4)
    a = make_seq("a", 9)
    s.add(a)
    out = run_step(s)
    assert planned(out.prefills) == [("a", 8)]
    out = run_step(s)  # the prompt's 9th token alone
    assert out.decodes == [] and planned(out.prefills) == [("a", 1)]
    assert a.num_output_tokens == 1
    out = run_step(s)  # now past its prompt: a decode
    assert planned(out.decodes) == [("a", 1)] and out.prefills == []
    pool.check_integrity()


def test_max_num_seqs_and_fcfs():
    pool = BlockPool(64)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100), pool, block_size=4)
    seqs = [make_seq(f"r{i}", 3) for i in range(3)]
    for q in seqs:
        s.add(q)
    out = run_step(s)
    assert [c.seq.request_id for c in out.prefills] == ["r0", "r1"]
    assert list(s.waiting) == [seqs[2]]
    s.finish(seqs[0], "stop")
    out = run_step(s)
    assert [c.seq.request_id for c in out.chunks] == ["r1", "r2"]


def test_preemption_of_latest_arrival_and_resume():
    pool = BlockPool(4)  # 16 token slots
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), pool, block_size=4)
    a, b = make_seq("a", 8), make_seq("b", 8)
    s.add(a)
    s.add(b)
    run_step(s)  # both prefilled: 2 blocks each, 9 tokens each after sampling
    assert pool.num_free == 0
    out = run_step(s)  # a needs a 3rd block -> b (latest) preempted
    assert [q.request_id for q in out.preempted] == ["b"]
    assert b.status is SeqStatus.WAITING and b.block_table == [] and b.num_computed_tokens == 0
    assert s.waiting[0] is b and b.num_tokens == 9  # keeps prompt + its sampled token
    s.finish(a, "stop")
    out = run_step(s)
    assert [(c.seq.request_id, c.num_tokens) for c in out.prefills] == [("b", 9)]  # recompute
    s.finish(b, "stop")
    pool.assert_all_free()


def test_self_preemption_when_no_victim():
    pool = BlockPool(3)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4), pool, block_size=4)
    a, b = make_seq("a", 8), make_seq("b", 8)
    s.add(a)
    s.add(b)
    out = run_step(s)  # budget 4: a's first chunk only
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("a", 4)]
    out = run_step(s)
    out = run_step(s)
    # progress continues and integrity holds whatever was preempted
    pool.check_integrity()
    for _ in range(20):
        run_step(s)
        for q in list(s.running):
            if q.num_output_tokens >= 2:
                s.finish(q, "length")
        if not s.has_work():
            break
    assert not s.has_work()
    pool.assert_all_free()


def test_shortest_first_policy_with_aging():
    """shortest-first admits the fewest-tokens-left prompt first; waiting ages a long prompt
    (aging_tokens_per_s per second) until it goes ahead of fresh short ones; FCFS keeps arrival order."""

    def admitted_first(policy: str, long_waited_s: float) -> str:
        pool = BlockPool(64)
        cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64, policy=policy, aging_tokens_per_s=100.0)
        sched = Scheduler(cfg, pool, block_size=4)
        long, short = make_seq("long", 40), make_seq("short", 8)
        long.arrival_time -= long_waited_s
        sched.add(long)
        sched.add(short)
        return sched.schedule().prefills[0].seq.request_id

    assert admitted_first("fcfs", 0.0) == "long"
    assert admitted_first("shortest-first", 0.0) == "short"
    assert admitted_first("shortest-first", 0.2) == "short"  # 40 - 20 > 8
    assert admitted_first("shortest-first", 0.5) == "long"  # 40 - 50 < 8: aged past the short one
    with pytest.raises(ValueError):
        SchedulerConfig(policy="random")


def test_in_flight_sequences_get_next_chunks_but_are_never_preempted():
    """Prefill lanes launch a step before the previous one finishes: a chunk counts as computed
    when launched, so the next schedule plans the chunk after it; a sequence whose chunk is in
    flight keeps its blocks (a lane is writing them), even when that means waiting for blocks."""
    pool = BlockPool(4)  # 16 token slots
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=4), pool, block_size=4)
    a, b = make_seq("a", 8), make_seq("b", 8)
    s.add(a)
    s.add(b)

    def launch(in_flight):
        out = s.schedule(frozenset(id(q) for q in in_flight))
        for c in out.chunks:
            c.seq.num_computed_tokens += c.num_tokens  # LLMEngine.launch
        return [(c.seq.request_id, c.num_tokens) for c in out.chunks], out

    assert launch([])[0] == [("a", 4)]
    assert launch([a])[0] == [("a", 4)]  # a's second chunk, its first still in flight
    assert launch([a])[0] == [("b", 4)]  # a has nothing left to compute: b is next
    assert launch([a, b])[0] == [("b", 4)]
    assert pool.num_free == 0
    a.token_ids.append(7)  # a sampled its first token; a and b are both still in flight
    chunks, out = launch([a, b])
    assert chunks == [] and out.preempted == []  # a waits for a block: b is not preempted, a not either
    assert a.block_table and b.block_table
    chunks, out = launch([a])  # b's steps are done: b may now be preempted for a
    assert [q.request_id for q in out.preempted] == ["b"] and chunks[0] == ("a", 1)
