"""The AIMD admission limit on synthetic step costs: it finds the largest batch that meets the
TPOT target, backs off on preemption and breaches, and stays within its bounds."""

from __future__ import annotations

import pytest

from pdserve.decode_node.aimd import AimdLimit, AimdSettings


def simulate(limit: AimdLimit, steps: int, demand: int, cost, kv_seats: int = 10**9) -> list[int]:
    """`demand` sequences always waiting; a step runs min(limit, demand) of them and costs
    cost(batch) seconds; more than `kv_seats` running preempts. Returns the limit per step."""
    seen = []
    for _ in range(steps):
        batch = min(limit.limit, demand)
        preempted = max(0, batch - kv_seats)
        limit.observe(cost(batch), batch, preempted)
        seen.append(limit.limit)
    return seen


def linear_cost(batch: int) -> float:  # 5 ms + 1 ms a sequence: the 60 ms target holds up to 55
    return 0.005 + 0.001 * batch


def test_grows_to_the_largest_batch_meeting_the_target():
    limit = AimdLimit(AimdSettings(min_seqs=4, max_seqs=256, target_step_s=0.060, cooldown_steps=2))
    seen = simulate(limit, 3000, demand=1000, cost=linear_cost)
    tail = seen[1500:]
    assert max(tail) <= 60  # never far past the 55 the target allows ...
    assert sum(tail) / len(tail) >= 35  # ... and on average well above half of it (sawtooth)
    assert limit.decreases > 0 and limit.increases > 0


def test_backs_off_on_preemption():
    limit = AimdLimit(AimdSettings(min_seqs=2, max_seqs=256, target_step_s=1.0, cooldown_steps=2))
    seen = simulate(limit, 2000, demand=1000, cost=lambda b: 0.001, kv_seats=20)  # time is no limit; KV is
    tail = seen[1000:]
    assert max(tail) <= 21 and min(tail) >= 10


def test_does_not_grow_when_the_limit_does_not_bind():
    limit = AimdLimit(AimdSettings(min_seqs=4, max_seqs=256, target_step_s=0.060), initial=8)
    simulate(limit, 100, demand=3, cost=linear_cost)  # only 3 sequences want to run
    assert limit.limit == 8 and limit.increases == 0


def test_one_slow_step_is_smoothed_but_a_slow_spell_is_not():
    limit = AimdLimit(AimdSettings(min_seqs=4, max_seqs=64, target_step_s=0.060), initial=32)
    for _ in range(20):
        limit.observe(0.030, 32, 0)
    at = limit.limit
    limit.observe(0.090, 32, 0)  # one outlier: EWMA 0.039
    assert limit.limit >= at
    for _ in range(5):
        limit.observe(0.200, 32, 0)
    assert limit.limit <= at // 2


def test_stays_within_its_bounds():
    limit = AimdLimit(AimdSettings(min_seqs=4, max_seqs=16, target_step_s=0.060, cooldown_steps=0))
    assert max(simulate(limit, 400, demand=1000, cost=lambda b: 0.001)) == 16
    assert min(simulate(limit, 200, demand=1000, cost=lambda b: 1.0)) == 4


def test_steps_up_once_a_round_not_every_step():
    limit = AimdLimit(AimdSettings(min_seqs=2, max_seqs=64, target_step_s=0.060, increase_every_steps=16))
    seen = simulate(limit, 160, demand=1000, cost=lambda b: 0.001)
    assert seen[14] == 2 and seen[15] == 3  # the 16th good step raises it
    assert limit.limit == 12  # 160 good steps: 10 increases


def test_refuses_bad_bounds():
    with pytest.raises(ValueError):
        AimdSettings(min_seqs=8, max_seqs=4, target_step_s=0.06)
