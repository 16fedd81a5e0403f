"""A decode worker paces its steps only while prompts for it queue behind a prefill, more the
more of them there are."""

from __future__ import annotations

import pytest

from pdserve.decode_node.step_pacing import RAMP_QUEUED, StepPacer

BACKLOG = RAMP_QUEUED + 1  # one prompt prefilling, RAMP_QUEUED waiting: the longest interval


def test_paces_only_while_prompts_queue_behind_a_prefill():
    pacer = StepPacer(max_interval_ms=30)
    assert pacer.delay_ms(prefills_in_flight=BACKLOG, now=5.0) == 0  # no step yet: go
    pacer.started(now=5.0)
    assert pacer.delay_ms(prefills_in_flight=0, now=5.001) == 0  # nothing waits for the core
    assert pacer.delay_ms(prefills_in_flight=1, now=5.001) == 0  # a lone prefill: nothing queues behind it
    assert pacer.delay_ms(prefills_in_flight=BACKLOG, now=5.001) == 29
    assert pacer.delay_ms(prefills_in_flight=BACKLOG, now=5.0295) == 1  # rounded up: never a busy poll(0)
    assert pacer.delay_ms(prefills_in_flight=BACKLOG, now=5.030) == 0


def test_interval_grows_with_the_queue_up_to_its_maximum():
    pacer = StepPacer(max_interval_ms=30)
    intervals = [pacer.interval_s(n) for n in range(BACKLOG + 3)]
    assert intervals[:2] == [0, 0] and intervals == sorted(intervals)
    assert intervals[2] == pytest.approx(0.030 / RAMP_QUEUED)
    assert intervals[BACKLOG:] == [pytest.approx(0.030)] * 3


def test_off_by_default():
    pacer = StepPacer()
    pacer.started(now=1.0)
    assert not pacer.enabled and pacer.delay_ms(prefills_in_flight=4, now=1.0) == 0


def test_rejects_a_negative_interval():
    with pytest.raises(ValueError):
        StepPacer(max_interval_ms=-1)
