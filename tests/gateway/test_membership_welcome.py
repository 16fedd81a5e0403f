"""A worker first heard by heartbeat is welcomed before any request can reach it.

The heartbeat thread does not wait for a Welcome, so after a gateway (re)start its first message
from a worker may be a Heartbeat. The worker is routable from then on; without a Welcome it has
no route back and drops the outputs of the requests it gets (seen as a hung 1P1D test)."""

from __future__ import annotations

import asyncio

from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.messages import Heartbeat, Register, Welcome, WorkerStats
from tests.gateway.conftest import gateway_with_fake_worker

AUTH = FrameAuth(b"w" * 32)


def test_worker_first_heard_by_heartbeat_is_welcomed(tmp_path):
    async def scenario() -> list:
        async with gateway_with_fake_worker(tmp_path, AUTH, "prefill-test-1", "prefill", num_blocks=4) as w:
            assert w.out.send(Heartbeat(worker_id=w.info.worker_id, stats=WorkerStats(), info=w.info))
            got = [await w.recv(2.0)]
            assert w.backend.table.live("prefill"), "the heartbeat did not make the worker routable"
            assert w.out.send(Register(info=w.info))  # a later Register is answered too
            got.append(await w.recv(2.0))
            return got

    got = asyncio.run(scenario())
    assert len(got) == 2 and all(isinstance(m, Welcome) for m in got), got
    assert got[0].gateway_id.startswith("gw-")
