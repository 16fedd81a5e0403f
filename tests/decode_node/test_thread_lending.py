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
