"""Request priority in the engine's scheduler (`SamplingParams.priority`, lower first): the
waiting order of every pool and who is preempted. Pure logic, no model."""

from pdserve.engine.block_pool import BlockPool
from pdserve.engine.config import SchedulerConfig
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import SeqStatus, Sequence
from pdserve.protocol.sampling import SamplingParams
from tests.engine.test_scheduler import run_step


def make_seq(rid: str, n_prompt: int, priority: int) -> Sequence:
    return Sequence(rid, list(range(1, n_prompt + 1)), n_prompt, SamplingParams(priority=priority))


def test_a_more_urgent_prompt_waits_ahead_of_a_flood_fcfs_within_a_priority():
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=100), BlockPool(64), block_size=4)
    flood = [make_seq(f"low{i}", 3, priority=10) for i in range(3)]
    for q in flood:
        s.add(q)
    urgent, same = make_seq("urgent", 3, priority=-1), make_seq("urgent2", 3, priority=-1)
    s.add(urgent)
    s.add(same)
    assert [q.request_id for q in s.waiting] == ["urgent", "urgent2", "low0", "low1", "low2"]
    out = run_step(s)
    assert [c.seq.request_id for c in out.prefills] == ["urgent"]


def test_one_priority_keeps_plain_fcfs():
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=100), BlockPool(64), block_size=4)
    for i in range(4):
        s.add(make_seq(f"r{i}", 3, priority=0))
    assert [q.request_id for q in s.waiting] == ["r0", "r1", "r2", "r3"]


def test_the_least_urgent_running_sequence_is_preempted_not_the_latest():
    pool = BlockPool(4)  # 16 token slots
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), pool, block_size=4)
    low, urgent = make_seq("low", 8, priority=5), make_seq("urgent", 8, priority=0)
    s.add(low)
    s.add(urgent)
    assert [q.request_id for q in s.waiting] == ["urgent", "low"]
    run_step(s)  # both prefilled: 2 blocks each
    assert pool.num_free == 0
    out = run_step(s)  # urgent needs a 3rd block: low goes, though it arrived (and ran) first
    assert [q.request_id for q in out.preempted] == ["low"]
    assert urgent.status is SeqStatus.RUNNING and low.status is SeqStatus.WAITING


def test_a_sequence_preempts_itself_rather_than_a_more_urgent_one():
    pool = BlockPool(4)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), pool, block_size=4)
    low, urgent = make_seq("low", 7, priority=5), make_seq("urgent", 7, priority=0)
    s.add(low)
    run_step(s)  # low alone: 2 blocks, 8 tokens
    s.add(urgent)
    run_step(s)  # low decodes into its 2nd block; urgent admitted: 2 blocks, none free
    assert pool.num_free == 0 and s.running == [low, urgent]
    out = run_step(s)  # low needs a 3rd block first; the only other runner is more urgent
    assert [q.request_id for q in out.preempted] == ["low"]
    assert urgent.status is SeqStatus.RUNNING and [c.seq for c in out.decodes] == [urgent]


def test_a_preempted_sequence_resumes_first_within_its_priority_only():
    pool = BlockPool(16)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64), pool, block_size=4)
    low, urgent = make_seq("low", 8, priority=5), make_seq("urgent", 8, priority=0)
    s.add(low)
    s.add(urgent)
    run_step(s)  # both run (two seats)
    s.add(make_seq("low-new", 3, priority=5))
    s.add(make_seq("urgent-new", 3, priority=0))
    s.preempt(low)  # back ahead of the new low, behind the new urgent
    assert [q.request_id for q in s.waiting] == ["urgent-new", "low", "low-new"]


def test_shortest_first_orders_within_a_priority():
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=100, policy="shortest-first")
    s = Scheduler(cfg, BlockPool(64), block_size=4)
    s.add(make_seq("short-low", 2, priority=3))
    s.add(make_seq("long-urgent", 30, priority=0))
    s.add(make_seq("short-urgent", 4, priority=0))
    out = run_step(s)
    assert [c.seq.request_id for c in out.prefills] == ["short-urgent"]
    assert [q.request_id for q in s.waiting] == ["long-urgent", "short-low"]
