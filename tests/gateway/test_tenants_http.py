"""API keys as tenants through the HTTP app (stub backend, hand-moved clock): exact counts under a
concurrent flood, 429s with Retry-After and OpenAI's x-ratelimit headers before any work reaches
the backend, the max_tokens cap, priorities reaching the admission queue, usage per key name."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pdserve.gateway.app import create_app
from pdserve.gateway.tenants import ApiKey, TenantDirectory, TenantLimits
from tests.gateway.stub_backend import StubBackend

PROMPT = [5, 6, 7, 8]
TEAM = ApiKey("team", "sk-team-secret", TenantLimits(requests_per_minute=20, max_concurrent_requests=10))
TOKENS = ApiKey("tokens", "sk-tokens-secret", TenantLimits(tokens_per_minute=100))
CAPPED = ApiKey("capped", "sk-capped-secret", TenantLimits(max_tokens_per_request=8, priority=5))
FREE = ApiKey("free", "sk-free-secret")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class GatedBackend(StubBackend):
    """The stub, each stream held before its first token until `gate` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()

    async def outputs(self, request_id, prompt_token_ids, sampling):
        await self.gate.wait()
        async for out in super().outputs(request_id, prompt_token_ids, sampling):
            yield out


def app_for(backend: StubBackend, tokenizer, clock: Clock):
    tenants = TenantDirectory.build("sk-single", [TEAM, TOKENS, CAPPED, FREE], clock)
    return create_app(backend, tokenizer, model_name="m", max_model_len=512, tenants=tenants)


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30)


def auth(key: ApiKey) -> dict[str, str]:
    return {"Authorization": f"Bearer {key.key}"}


def body(**kw) -> dict:
    return {"prompt": PROMPT, "max_tokens": 2, **kw}


async def flood(c: httpx.AsyncClient, backend: GatedBackend, n: int, expect_refused: int) -> list[httpx.Response]:
    """`n` concurrent requests of TEAM, held at the backend until `expect_refused` have been refused."""
    backend.gate.clear()
    tasks = [asyncio.create_task(c.post("/v1/completions", json=body(), headers=auth(TEAM))) for _ in range(n)]
    for _ in range(1000):
        if sum(t.done() for t in tasks) >= expect_refused:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # (no more than those may end while the rest are held)
    assert sum(t.done() for t in tasks) == expect_refused
    backend.gate.set()
    return await asyncio.gather(*tasks)


def metric(text: str, name: str, **labels: str) -> float:
    want = name + "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}"
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(want + " "))


def test_a_concurrent_flood_gets_exactly_the_allowed_number_through(tokenizer):
    async def go():
        clock, backend = Clock(), GatedBackend()
        app = app_for(backend, tokenizer, clock)
        gw = app.state.gateway
        team = gw.tenants.lookup(f"Bearer {TEAM.key}".encode())
        async with client(app) as c:
            # 1. 50 at once: 10 in flight at most, the other 40 refused while those are held
            first = await flood(c, backend, 50, expect_refused=40)
            ok = [r for r in first if r.status_code == 200]
            refused = [r for r in first if r.status_code == 429]
            assert len(ok) == 10 and len(refused) == 40
            assert sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in ok) == list(range(10, 20))
            for r in ok:
                assert r.headers["x-ratelimit-limit-requests"] == "20"
            for r in refused:
                err = r.json()["error"]
                assert err["code"] == "rate_limit_exceeded" and err["type"] == "requests"
                assert "max_concurrent_requests 10" in err["message"]
                assert r.headers["Retry-After"] == "1"
                assert r.headers["x-ratelimit-limit-requests"] == "20"
                assert r.headers["x-ratelimit-remaining-requests"] == "10"
                assert r.headers["x-ratelimit-reset-requests"] == "30s"  # 10 short at 1 per 3 s

            # 2. again: the 10 left in the minute go through
            second = await flood(c, backend, 50, expect_refused=40)
            assert sorted(r.status_code for r in second) == [200] * 10 + [429] * 40

            # 3. the minute's 20 are spent: every one refused at once, for the rate this time
            backend.gate.set()
            third = await asyncio.gather(
                *(c.post("/v1/completions", json=body(), headers=auth(TEAM)) for _ in range(50))
            )
            assert {r.status_code for r in third} == {429}
            for r in third:
                assert "requests per minute" in r.json()["error"]["message"]
                assert r.headers["Retry-After"] == "3"  # one request every 3 s
                assert r.headers["x-ratelimit-remaining-requests"] == "0"
                assert r.headers["x-ratelimit-reset-requests"] == "1m0s"

            # 4. three seconds on: exactly one more
            clock.now += 3
            fourth = await asyncio.gather(
                *(c.post("/v1/completions", json=body(), headers=auth(TEAM)) for _ in range(5))
            )
            assert sorted(r.status_code for r in fourth) == [200] + [429] * 4

            # every admitted request reached the backend and ended; no refused one did
            assert len(backend.started) == len(backend.finished) == 21 and not backend.aborted
            assert team.in_flight == 0 and gw.in_flight == 0
            text = (await c.get("/metrics")).text
        assert metric(text, "pdserve_gateway_requests_in_flight") == 0
        assert metric(text, "pdserve_key_requests_total", key="team") == 21
        assert metric(text, "pdserve_key_prompt_tokens_total", key="team") == 21 * len(PROMPT)
        assert metric(text, "pdserve_key_completion_tokens_total", key="team") == 21 * 2
        assert metric(text, "pdserve_key_rate_limited_total", key="team", limit="concurrency") == 80
        assert metric(text, "pdserve_key_rate_limited_total", key="team", limit="requests") == 54
        assert metric(text, "pdserve_http_errors_total", status="429") == 134
        assert TEAM.key not in text

    asyncio.run(go())


def test_tokens_per_minute_charge_prompt_plus_max_tokens_and_refund_the_unused(tokenizer):
    async def go():
        clock, backend = Clock(), StubBackend()
        app = app_for(backend, tokenizer, clock)
        async with client(app) as c:
            post = lambda **kw: c.post("/v1/completions", json=body(**kw), headers=auth(TOKENS))  # noqa: E731
            r = await post(max_tokens=16, stop_token_ids=[PROMPT[0]])  # charged 20, used 5 (stops at once)
            assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == 5
            assert r.headers["x-ratelimit-limit-tokens"] == "100"
            assert r.headers["x-ratelimit-remaining-tokens"] == "80"
            assert "x-ratelimit-limit-requests" not in r.headers
            r = await post(max_tokens=16)  # 95 left after the refund: charged 20
            assert r.headers["x-ratelimit-remaining-tokens"] == "75"
            r = await post(max_tokens=60)  # charged 64: 11 left
            assert r.status_code == 200 and r.headers["x-ratelimit-remaining-tokens"] == "11"
            started = len(backend.started)
            r = await post(max_tokens=16)
            assert r.status_code == 429 and r.json()["error"]["type"] == "tokens"
            assert r.headers["Retry-After"] == "6" and r.headers["x-ratelimit-remaining-tokens"] == "11"
            r = await post(max_tokens=200)  # more than a minute's allowance: never, not later
            assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"
            assert len(backend.started) == started  # neither reached the backend
            r = await post(max_tokens=4, n=2)  # 4 + 2 x 4 = 12 > 11: per sequence
            assert r.status_code == 429
            clock.now += 1  # + 1.67 tokens
            r = await post(max_tokens=4, n=2)
            assert r.status_code == 200

    asyncio.run(go())


def test_max_tokens_cap_unknown_keys_priority_and_streams(tokenizer):
    async def go():
        backend = StubBackend()
        app = app_for(backend, tokenizer, Clock())
        async with client(app) as c:
            r = await c.post("/v1/completions", json=body(max_tokens=9), headers=auth(CAPPED))
            assert r.status_code == 400 and r.json()["error"]["code"] == "max_tokens_over_key_limit"
            assert not backend.started
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            r = await c.post("/v1/chat/completions", json=chat, headers=auth(CAPPED))  # no max_tokens: the cap
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
            assert "x-ratelimit-limit-requests" not in r.headers  # no rate limits, no headers
            for headers in ({}, {"Authorization": "Bearer sk-nope"}, {"Authorization": TEAM.key}):
                r = await c.post("/v1/completions", json=body(), headers=headers)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            r = await c.post("/v1/completions", json=body(), headers={"Authorization": "Bearer sk-single"})
            assert r.status_code == 200  # --api-key's key, next to the file's

            # priority: the request's own, else its key's default, reaches the admission queue
            await c.post("/v1/completions", json=body(), headers=auth(CAPPED))
            await c.post("/v1/completions", json=body(priority=-3), headers=auth(CAPPED))
            await c.post("/v1/completions", json=body(), headers=auth(FREE))
            assert list(backend.priorities.values())[-3:] == [5, -3, 0]
            r = await c.post("/v1/completions", json=body(priority="high"), headers=auth(FREE))
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority"

            async with c.stream("POST", "/v1/completions", json=body(stream=True), headers=auth(TEAM)) as s:
                assert s.status_code == 200 and s.headers["x-ratelimit-remaining-requests"] == "19"
                assert (await s.aread()).endswith(b"data: [DONE]\n\n")
            text = (await c.get("/metrics")).text
        assert metric(text, "pdserve_key_requests_total", key="capped") == 3
        assert metric(text, "pdserve_key_requests_total", key="default") == 1
        assert all(t.in_flight == 0 for t in app.state.gateway.tenants.gates())

    asyncio.run(go())


def test_a_stream_whose_client_left_before_the_first_byte_frees_its_slot(tokenizer):
    """Its event generator never starts, so the response itself must end the run."""

    async def go():
        backend = StubBackend()
        backend.delay_s = 0.01
        app = app_for(backend, tokenizer, Clock())
        team = app.state.gateway.tenants.lookup(f"Bearer {TEAM.key}".encode())
        request = json.dumps(body(max_tokens=50, stream=True)).encode()
        messages = [{"type": "http.request", "body": request, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop()
            await asyncio.sleep(3600)

        async def send(message):
            raise OSError("the client is gone")

        headers = [(b"authorization", f"Bearer {TEAM.key}".encode()), (b"content-type", b"application/json")]
        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/completions",
            "headers": headers,
            "query_string": b"",
            "http_version": "1.1",
            "scheme": "http",
            "server": ("test", 80),
            "client": ("client", 1),
            "root_path": "",
        }
        with pytest.raises(OSError):
            await app(scope, receive, send)
        assert team.in_flight == 0 and app.state.gateway.in_flight == 0
        assert len(backend.aborted) == 1 and not backend.finished  # aborted upstream, not run unread

    asyncio.run(go())
