"""Connections against a real uvicorn server (loopback, free port, always stopped): a stalled
reader is cut and aborted upstream while others stream; slow-header and slow-body clients block
no one; bodies at and over the size limit."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from transformers import AutoTokenizer

from pdserve.engine.tokenizer_builder import build_tokenizer
from pdserve.gateway.app import create_app
from pdserve.gateway.limits import GatewayLimits
from tests.gateway.stub_backend import StubBackend

LIMITS = GatewayLimits(max_body_bytes=4096, body_read_timeout_s=1.0, max_stream_buffer=64,
                       stream_write_timeout_s=1.0)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path, 512)
    return AutoTokenizer.from_pretrained(path)


@pytest.fixture
def server(tokenizer):
    """(base url, backend) of a uvicorn server in a thread of its own; stopped afterwards."""
    backend = StubBackend()
    backend.delay_s = 0.001
    app = create_app(backend, tokenizer, model_name="m", max_model_len=10**6, limits=LIMITS)
    sock = socket.socket()
    # small kernel send buffers (accepted sockets inherit them): a stalled reader's socket fills
    # after a few hundred events instead of megabytes
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", backlog=2048))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", backend, app
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        sock.close()


async def stream_tokens(client: httpx.AsyncClient, prompt: list[int], n: int) -> int:
    """Tokens in one streamed completion (all of its events read)."""
    got = 0
    async with client.stream("POST", "/v1/completions",
                             json={"prompt": prompt, "max_tokens": n, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                got += sum(1 for c in event["choices"] if c["text"] or c["finish_reason"] == "length")
    return got


def others_stream(base: str, n_clients: int = 8, tokens: int = 50) -> float:
    """Seconds for `n_clients` concurrent streams of `tokens` tokens each, all checked whole."""
    async def go():
        async with httpx.AsyncClient(base_url=base, timeout=30) as c:
            t0 = time.monotonic()
            counts = await asyncio.gather(*[stream_tokens(c, [5 + i], tokens) for i in range(n_clients)])
            assert all(k >= tokens - 1 for k in counts), counts
            return time.monotonic() - t0
    return asyncio.run(go())


def raw_request(port: int, body: bytes, *, rcvbuf: int | None = None, path: str = "/v1/completions") -> socket.socket:
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def test_a_stalled_reader_is_cut_and_aborted_while_others_stream(server):
    base, backend, app = server
    port = int(base.rsplit(":", 1)[1])
    # a client that asks for a long stream and never reads it
    stalled = raw_request(port, json.dumps({"prompt": [9, 9], "max_tokens": 500_000, "stream": True}).encode(),
                          rcvbuf=4096)
    try:
        t0 = time.monotonic()
        took = others_stream(base)  # meanwhile other clients stream normally
        assert took < 10, f"other streams took {took:.1f}s beside a stalled reader"
        deadline = time.monotonic() + 10
        while not backend.aborted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert backend.aborted, "the stalled stream was never aborted upstream"
        aborted_after = time.monotonic() - t0
        assert len(backend.started) == 9 and len(backend.finished) == 8
        # its pending write times out: the response ends, the connection closes, nothing in flight
        deadline = time.monotonic() + 10
        while app.state.gateway.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert app.state.gateway.in_flight == 0
        stalled.settimeout(5)
        received = 0
        while chunk := stalled.recv(1 << 16):  # what the kernel held, then EOF: closed by the server
            received += len(chunk)
        cuts = {line.split()[0]: float(line.split()[-1]) for line in httpx.get(f"{base}/metrics").text.splitlines()
                if line.startswith("pdserve_streams_cut_total")}
        assert cuts == {'pdserve_streams_cut_total{reason="buffer_full"}': 1.0,
                        'pdserve_streams_cut_total{reason="write_timeout"}': 1.0}, cuts
        print(f"stalled reader: aborted upstream after {aborted_after:.1f}s, connection closed after "
              f"{time.monotonic() - t0:.1f}s with {received} bytes delivered")
    finally:
        stalled.close()


def test_slow_header_and_slow_body_clients_block_no_one(server):
    base, backend, _ = server
    port = int(base.rsplit(":", 1)[1])
    slow_header = socket.create_connection(("127.0.0.1", port))
    slow_header.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
    slow_body = socket.create_connection(("127.0.0.1", port))
    slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # 11 of 100 bytes, then silence
    try:
        assert others_stream(base) < 10
        slow_body.settimeout(5)
        answer = slow_body.recv(65536).decode()  # the body never came: 408 after the read timeout
        assert answer.startswith("HTTP/1.1 408") and '"code":"body_timeout"' in answer.replace(" ", ""), answer
    finally:
        slow_header.close()
        slow_body.close()


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_at_the_limit_is_read_and_one_byte_over_is_413(server, chunked):
    base, _, _ = server
    prefix = json.dumps({"prompt": [5, 6], "max_tokens": 2})
    at_limit = prefix[:-1] + " " * (LIMITS.max_body_bytes - len(prefix)) + "}"
    assert len(at_limit) == LIMITS.max_body_bytes

    def post(body: str) -> httpx.Response:
        content = iter([body.encode()]) if chunked else body.encode()  # an iterator: chunked encoding
        return httpx.post(f"{base}/v1/completions", content=content, headers={"content-type": "application/json"},
                          timeout=10)
    ok, over = post(at_limit), post(at_limit + " ")
    assert ok.status_code == 200, ok.text
    assert over.status_code == 413 and over.json()["error"]["code"] == "body_too_large"


def test_a_thousand_concurrent_streams(server):
    base, backend, _ = server
    n = 1000

    async def go():
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as c:
            return await asyncio.gather(*[stream_tokens(c, [5 + i % 50], 8) for i in range(n)])
    t0 = time.monotonic()
    counts = asyncio.run(go())
    took = time.monotonic() - t0
    assert counts == [8] * n and len(backend.finished) == n and backend.aborted == []
    print(f"{n} concurrent streams in {took:.1f}s")
