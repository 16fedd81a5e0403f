"""A group (n, best_of, beams) whose sequences at full length cannot fit any decode worker's KV
pool gets 400 before any work, with what to change; one that fits is not refused."""

from __future__ import annotations

import asyncio

import httpx
import zmq

from pdserve.gateway.app import create_app
from pdserve.gateway.cluster_backend import ClusterBackend
from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.channel import Inbox, Outbox
from pdserve.protocol.messages import Register
from tests.gateway.conftest import fake_worker

AUTH = FrameAuth(b"g" * 32)


def test_a_group_that_cannot_fit_gets_400(tmp_path, tokenizer):
    async def scenario() -> None:
        backend = ClusterBackend(AUTH, f"ipc://{tmp_path}/gw.sock")
        await backend.start()
        ctx = zmq.Context()
        boxes = [Inbox(ctx, AUTH, f"ipc://{tmp_path}/{role}.sock") for role in ("prefill", "decode")]
        out = Outbox(ctx, AUTH, backend.inbox_addr)
        app = create_app(backend, tokenizer, model_name="m", max_model_len=512)
        try:
            for role, box in zip(("prefill", "decode"), boxes):
                info = fake_worker(f"{role}-1", role, box.addr, num_blocks=40, max_num_seqs=64)
                out.send(Register(info=info))
            for _ in range(150):
                await asyncio.sleep(0.02)
                if backend.table.live("prefill") and backend.table.live("decode"):
                    break
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                body = {"model": "m", "prompt": "hello there", "max_tokens": 200, "n": 8, "temperature": 1}
                r = await c.post("/v1/completions", json=body)  # 8 x 13 blocks > 40
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert err["code"] == "request_too_large" and "lower n" in err["message"]
                assert "retry-after" not in r.headers
                body["use_beam_search"], body["temperature"], body["n"] = True, 0, 4  # 4 beams: 52 > 40
                assert (await c.post("/v1/completions", json=body)).status_code == 400
                backend._check_group_fits(3, backend_sampling(n=2, max_tokens=200))  # 2 x 13 fits: no error
        finally:
            out.close()
            for box in boxes:
                box.close()
            ctx.term()
            await backend.stop()

    asyncio.run(scenario())


def backend_sampling(n: int, max_tokens: int):
    from pdserve.protocol.sampling import SamplingParams

    return SamplingParams(n=n, max_tokens=max_tokens, temperature=1.0)
