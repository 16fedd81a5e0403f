"""A decode worker steps with the prefill cores while no prefill for it is in flight."""

from __future__ import annotations

import pytest
import torch

from pdserve.decode_node.thread_lending import ThreadLending


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_lends_only_while_no_prefill_is_in_flight(restore_threads):
    torch.set_num_threads(1)
    lending = ThreadLending(busy=1, idle=2)
    assert lending.enabled
    lending.update(prefills_in_flight=0)
    assert torch.get_num_threads() == 2
    lending.update(prefills_in_flight=3)  # reservations arrived: prefills need their cores back
    assert torch.get_num_threads() == 1
    lending.update(prefills_in_flight=1)
    assert torch.get_num_threads() == 1 and lending.switches == 2


def test_off_when_idle_equals_busy(restore_threads):
    torch.set_num_threads(1)
    lending = ThreadLending(busy=1, idle=1)
    assert not lending.enabled
    lending.update(prefills_in_flight=0)
    assert torch.get_num_threads() == 1 and lending.switches == 0


def test_rejects_fewer_idle_than_busy_threads():
    with pytest.raises(ValueError):
        ThreadLending(busy=2, idle=1)


def test_stops_lending_where_lent_steps_are_measured_slower(restore_threads):
    """Another job on the lent core: two-thread steps stall. Once both ways are measured the
    worker keeps to its own threads, but for rare explorations."""
    torch.set_num_threads(1)
    lending = ThreadLending(busy=1, idle=2)
    lent = []
    for _ in range(200):
        lending.update(prefills_in_flight=0, running=4)
        lent.append(torch.get_num_threads() == 2)
        lending.observe(4, 0.050 if lent[-1] else 0.015, 4)  # lent: 12.5 ms/token, own: 3.75
    assert sum(lent[:3]) == 3  # lending is tried first
    assert sum(lent[20:]) <= 180 // 16 + 1


def test_keeps_lending_where_it_pays(restore_threads):
    torch.set_num_threads(1)
    lending = ThreadLending(busy=1, idle=2)
    lent = []
    for _ in range(200):
        lending.update(prefills_in_flight=0, running=1)
        lent.append(torch.get_num_threads() == 2)
        lending.observe(1, 0.009 if lent[-1] else 0.015, 1)
    assert sum(lent[20:]) >= 180 - 180 // 16 - 1
