"""Live membership at the gateway, without worker processes: a worker is welcomed at the address
it registered through, a draining worker gets nothing new but keeps what it holds, a
deregistered one is gone at once and its late heartbeats do not bring it back, `/v1/workers`
lists them, and `/cluster/join` answers only holders of the cluster secret."""

from __future__ import annotations

import asyncio
import logging

import httpx
import msgspec

from pdserve.gateway.app import create_app
from pdserve.gateway.cluster_backend import ClusterBackend
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.join import JOIN_PATH, sign_join
from pdserve.protocol.messages import Deregister, Heartbeat, Register, Welcome, WorkerStats
from tests.gateway.conftest import gateway_with_fake_worker

AUTH = FrameAuth(b"w" * 32)


async def _until(cond, timeout_s: float = 3.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if cond():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not met in time")


def test_welcome_via_draining_and_deregister(tmp_path):
    async def scenario() -> None:
        async with gateway_with_fake_worker(tmp_path, AUTH, "decode-1", "decode") as w:
            backend, out, info = w.backend, w.out, w.info
            # registered through a name the gateway never bound (a Service): welcomed at that name
            out.send(Register(info=info, via="tcp://pdserve-gateway-internal:7100"))
            welcome = await w.recv()
            assert isinstance(welcome, Welcome) and welcome.inbox_addr == "tcp://pdserve-gateway-internal:7100"
            out.send(
                Heartbeat(worker_id=info.worker_id, stats=WorkerStats(kv_blocks_total=8, kv_blocks_free=6), info=info)
            )
            await _until(lambda: backend.table.workers["decode-1"].stats.kv_blocks_total == 8)
            assert backend.table.live("decode")
            (listed,) = backend.workers()
            assert listed["state"] == "ready" and listed["kv"]["blocks_used"] == 2 and listed["role"] == "decode"

            out.send(Heartbeat(worker_id=info.worker_id, stats=WorkerStats(draining=True), info=info))
            await _until(lambda: not backend.table.live("decode"))
            entry = backend.table.get("decode-1")
            assert entry is not None and backend.table.is_live(entry)  # what it holds is still watched
            assert backend.workers()[0]["state"] == "draining"
            assert backend._free_decode_seats() == 0  # admission counts no seat there

            out.send(Deregister(worker_id=info.worker_id, reason="drained"))
            await _until(lambda: backend.table.get("decode-1") is None)
            assert not backend.table.is_live(entry)  # requests holding the entry see it gone
            out.send(Heartbeat(worker_id=info.worker_id, stats=WorkerStats(), info=info))  # late, other socket
            await asyncio.sleep(0.3)
            assert backend.table.get("decode-1") is None and backend.workers() == []

    asyncio.run(scenario())


def test_join_by_url_needs_the_cluster_secret(tmp_path, tokenizer, caplog):
    async def scenario() -> None:
        backend = ClusterBackend(AUTH, "tcp://127.0.0.1:0")
        await backend.start()
        app = create_app(backend, tokenizer, model_name="m", max_model_len=64, api_key="sk-test")
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://10.9.8.7:8000") as c:
                good = await c.post(JOIN_PATH, content=msgspec.json.encode(sign_join(AUTH, "decode", "h1")))
                assert good.status_code == 200, good.text  # no API key needed: the secret is the proof
                assert good.json()["worker_addr"] == backend.inbox_addr
                assert good.json()["gateway_id"] == backend.gateway_id

                wrong = FrameAuth(b"x" * 32)
                with caplog.at_level(logging.WARNING, logger="pdserve.gateway.app"):
                    bad = await c.post(JOIN_PATH, content=msgspec.json.encode(sign_join(wrong, "decode", "h2")))
                assert bad.status_code == 403 and bad.json()["error"]["code"] == "join_refused"
                assert "cluster's secret" in bad.json()["error"]["message"]
                assert any("join refused" in r.getMessage() for r in caplog.records)  # the gateway says why

                stale = await c.post(JOIN_PATH, content=msgspec.json.encode(sign_join(AUTH, "decode", "h", now=1.0)))
                assert stale.status_code == 403 and "replay" in stale.json()["error"]["message"]
                garbage = await c.post(JOIN_PATH, content=b"{not json")
                assert garbage.status_code == 403
                huge = await c.post(JOIN_PATH, content=b"x" * 100_000)
                assert huge.status_code == 413

                listed = await c.get("/v1/workers")
                assert listed.status_code == 401  # /v1 keeps its API key
                listed = await c.get("/v1/workers", headers={"Authorization": "Bearer sk-test"})
                assert listed.status_code == 200 and listed.json() == {"object": "list", "data": []}
        finally:
            await backend.stop()

    asyncio.run(scenario())


def test_worker_plane_address_for_a_wildcard_bind():
    from pdserve.protocol.join import worker_plane_addr

    assert worker_plane_addr("tcp://0.0.0.0:7100", None, "gw.example") == "tcp://gw.example:7100"
    assert worker_plane_addr("tcp://0.0.0.0:7100", None, "fd00::5") == "tcp://[fd00::5]:7100"
    assert worker_plane_addr("tcp://10.0.0.5:7100", None, "gw.example") == "tcp://10.0.0.5:7100"
    assert worker_plane_addr("tcp://0.0.0.0:7100", "tcp://svc:7100", "x") == "tcp://svc:7100"
