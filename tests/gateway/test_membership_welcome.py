"""A worker first heard by heartbeat is welcomed before any request can reach it.

The heartbeat thread does not wait for a Welcome, so after a gateway (re)start its first message
from a worker may be a Heartbeat. The worker is routable from then on; without a Welcome it has
no route back and drops the outputs of the requests it gets (seen as a hung 1P1D test)."""

from __future__ import annotations

import asyncio

import zmq

from pdserve.gateway.cluster_backend import ClusterBackend
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.channel import Inbox, Outbox
from pdserve.protocol.messages import Heartbeat, Register, Welcome, WorkerStats
from tests.gateway.conftest import fake_worker

AUTH = FrameAuth(b"w" * 32)


def test_worker_first_heard_by_heartbeat_is_welcomed(tmp_path):
    async def scenario() -> list:
        backend = ClusterBackend(AUTH, f"ipc://{tmp_path}/gw.sock")
        await backend.start()
        ctx = zmq.Context()
        worker_inbox = Inbox(ctx, AUTH, f"ipc://{tmp_path}/worker.sock")
        to_gateway = Outbox(ctx, AUTH, backend.inbox_addr)
        info = fake_worker("prefill-test-1", "prefill", worker_inbox.addr, num_blocks=4)
        try:
            assert to_gateway.send(Heartbeat(worker_id=info.worker_id, stats=WorkerStats(), info=info))
            got = []
            for _ in range(100):  # the gateway's receive loop runs on this event loop
                await asyncio.sleep(0.02)
                msg = worker_inbox.recv_one(0)
                if msg is not None:
                    got.append(msg)
                    break
            assert backend.table.live("prefill"), "the heartbeat did not make the worker routable"
            assert to_gateway.send(Register(info=info))  # a later Register is answered too
            for _ in range(100):
                await asyncio.sleep(0.02)
                msg = worker_inbox.recv_one(0)
                if msg is not None:
                    got.append(msg)
                    break
            return got
        finally:
            to_gateway.close()
            worker_inbox.close()
            ctx.term()
            await backend.stop()

    got = asyncio.run(scenario())
    assert len(got) == 2 and all(isinstance(m, Welcome) for m in got), got
    assert got[0].gateway_id.startswith("gw-")
