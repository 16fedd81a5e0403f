"""Connections against a real uvicorn server (loopback, free port, always stopped) serving the app
over the stub backend with gateway/slow_clients.py's protocol: 1000 concurrent streams (the server
in a process of its own, as users run it); a stalled reader is cut and aborted upstream while
others stream; slow-header and slow-body clients block no one and are answered; a request sent in
time is answered though the server's loop fell behind past the header deadline; a 408 read late
is whole; bodies at and over the size limit."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from pdserve.gateway.app import create_app
from pdserve.gateway.limits import GatewayLimits
from pdserve.gateway.slow_clients import http_protocol
from tests.gateway.stub_server import CountingBackend

LIMITS = GatewayLimits(
    max_body_bytes=4096,
    body_read_timeout_s=1.0,
    header_timeout_s=1.0,
    max_header_bytes=8192,
    max_stream_buffer=64,
    stream_write_timeout_s=1.0,
)


class Served:
    def __init__(self, server: uvicorn.Server, port: int, backend: CountingBackend, app) -> None:
        self.server, self.port, self.backend, self.app = server, port, backend, app
        self.base = f"http://127.0.0.1:{port}"
        self.gw = app.state.gateway

    def cuts(self) -> dict[str, float]:
        return {
            s.labels["reason"]: s.value
            for m in self.gw.metrics.streams_cut.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }

    def header_deadlines(self) -> dict[str, float]:
        return {
            s.labels["outcome"]: s.value
            for m in self.gw.metrics.header_deadlines.collect()
            for s in m.samples
            if s.name.endswith("_total")
        }


@contextlib.contextmanager
def serving(tokenizer, limits: GatewayLimits = LIMITS):
    """A uvicorn server in a thread of its own, as gateway/server.py configures it; stopped after."""
    backend = CountingBackend()
    app = create_app(backend, tokenizer, model_name="m", max_model_len=10**6, limits=limits)
    gw = app.state.gateway
    sock = socket.socket()
    # small kernel send buffers (accepted sockets inherit them): a stalled reader's socket fills
    # after a few hundred events instead of megabytes
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(
        uvicorn.Config(
            app, log_level="warning", lifespan="off", http=http_protocol(gw.limits, gw.stream_cut, gw.header_deadline)
        )
    )
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not srv.started:
            assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.02)
        yield Served(srv, sock.getsockname()[1], backend, app)
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture
def served(tokenizer):
    with serving(tokenizer) as s:
        yield s


class ServedElsewhere:
    """tests/gateway/stub_server.py in a process of its own, with the gateway's default limits."""

    def __init__(self, proc: subprocess.Popen, port: int) -> None:
        self.proc, self.port = proc, port

    def stats(self) -> dict:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def settled(self, timeout_s: float = 10.0) -> dict:
        """Its stats once no request is in flight and no connection open."""
        t0 = time.monotonic()
        while (stats := self.stats())["in_flight"] or stats["connections"]:
            assert time.monotonic() - t0 < timeout_s, stats
            time.sleep(0.05)
        return stats


@contextlib.contextmanager
def serving_in_own_process(tokenizer_dir: Path, hold_until: int = 0):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(2048)
    args = [str(tokenizer_dir), str(sock.fileno()), str(hold_until)]
    cmd = [sys.executable, "-m", "tests.gateway.stub_server", *args]
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        cmd, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=[sock.fileno()]
    )
    try:
        assert proc.stdout and proc.stdout.readline().strip() == "ready", "stub server did not start"
        yield ServedElsewhere(proc, sock.getsockname()[1])
    finally:
        sock.close()
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()  # type: ignore[union-attr]
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class RssPeak:
    """Peak resident memory of this process (server and clients) above its level at start, and
    the peak of `gauge()`, sampled alongside."""

    def __init__(self, gauge=lambda: 0) -> None:
        self.gauge, self.gauge_peak = gauge, 0

    def __enter__(self):
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def _sample(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._rss())
            self.gauge_peak = max(self.gauge_peak, self.gauge())

    @property
    def delta_mib(self) -> float:
        return (self.peak - self.base) / 2**20


# --- raw HTTP/1.1 clients ---------------------------------------------------------------------
def request_bytes(body: bytes, path: str = "/v1/completions") -> bytes:
    return (
        b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def completion(prompt: list[int], n: int, stream: bool = True) -> bytes:
    return json.dumps({"prompt": prompt, "max_tokens": n, "stream": stream}).encode()


def dechunk(raw: bytes) -> tuple[bytes, bytes]:
    """(head, body) of one HTTP/1.1 response read to its end, chunked transfer-encoding undone."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" not in head.lower():
        return head, rest
    body = bytearray()
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        body += rest[:n]
        rest = rest[n + 2 :]
    return head, bytes(body)


def sse_tokens(body: bytes) -> tuple[int, list[dict], bool]:
    """(tokens, error events, ended with [DONE]) of an SSE completions body."""
    tokens, errors = 0, []
    for line in body.decode().splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
            else:
                tokens += sum(1 for c in event["choices"] if c["text"] or c["finish_reason"] == "length")
    return tokens, errors, body.rstrip().endswith(b"data: [DONE]")


async def exchange(port: int, data: bytes, *, dribble: bytes = b"", every_s: float = 0.1) -> tuple[bytes, float]:
    """Sends `data`, then `dribble` one byte per `every_s`, while reading; returns (what came back
    until the server closed, seconds until then)."""
    t0 = time.monotonic()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)

    async def drip():
        with contextlib.suppress(ConnectionError):
            for i in range(len(dribble)):
                await asyncio.sleep(every_s)
                writer.write(dribble[i : i + 1])
                await writer.drain()

    dripping = asyncio.create_task(drip())
    try:
        got = bytearray()
        with contextlib.suppress(ConnectionResetError):
            while chunk := await reader.read(1 << 16):
                got += chunk
        return bytes(got), time.monotonic() - t0
    finally:
        dripping.cancel()
        writer.close()


async def stream_whole(port: int, prompt: list[int], n: int) -> int:
    """Tokens of one streamed completion, checked whole."""
    raw, _ = await exchange(port, request_bytes(completion(prompt, n)))
    head, body = dechunk(raw)
    assert head.startswith(b"HTTP/1.1 200"), head
    tokens, errors, done = sse_tokens(body)
    assert not errors and done, body[-300:]
    return tokens


async def others_stream(port: int, n_clients: int = 8, tokens: int = 50) -> float:
    """Seconds for `n_clients` concurrent streams of `tokens` tokens each, all checked whole."""
    t0 = time.monotonic()
    counts = await asyncio.gather(*[stream_whole(port, [5 + i], tokens) for i in range(n_clients)])
    assert counts == [tokens] * n_clients
    return time.monotonic() - t0


def stalled_reader(port: int, body: bytes) -> socket.socket:
    """A client that sends its request and reads nothing (a small receive buffer)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(request_bytes(body))
    return s


def wait_until(cond, timeout_s: float = 10.0) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "timed out waiting"
        time.sleep(0.01)
    return time.monotonic() - t0


# --- tests --------------------------------------------------------------------------------------
def test_a_thousand_concurrent_streams(tokenizer_dir):
    """1000 clients in this process against the server in its own, as users run it (sharing one
    process and its GIL, each side's lag was the other's: the 1000th client's request came
    0.7 s after its connection was accepted, and then waited 0.5 s for the server's loop)."""
    n, tokens = 1000, 16

    async def go():
        return await asyncio.gather(*[stream_whole(served.port, [5 + i % 50, 7], tokens) for i in range(n)])

    with serving_in_own_process(tokenizer_dir, hold_until=n) as served, RssPeak() as clients:
        t0 = time.monotonic()
        counts = asyncio.run(go())
        took = time.monotonic() - t0
        stats = served.settled()
    assert counts == [tokens] * n
    assert stats["started"] == stats["finished"] == n and stats["aborted"] == 0, stats
    rss_mib = stats["rss_growth_mib"] + clients.delta_mib
    print(
        f"{n} concurrent streams of {tokens} tokens in {took:.1f}s, up to {stats['peak_in_flight']} at once; "
        f"RSS +{stats['rss_growth_mib']:.0f} MiB server, +{clients.delta_mib:.0f} MiB clients; "
        f"header deadlines {stats['header_deadlines']}"
    )
    assert stats["peak_in_flight"] == n, stats  # all at once: the first tokens waited for the 1000th
    assert rss_mib < 256, f"RSS grew {rss_mib:.0f} MiB for {n} streams"
    assert stats["header_deadlines"] == {}, stats  # nobody was refused, no deadline was even near


def stall_server_loop_in_io(served: Served, seconds: float) -> socket.socket:
    """Makes the server's loop run a socket-read callback that blocks it for `seconds` (a loop
    busy with other connections' I/O); returns the socket to close afterwards."""
    loop = next(iter(served.server.server_state.connections)).loop
    r, w = socket.socketpair()

    def stall() -> None:
        loop.remove_reader(r.fileno())
        time.sleep(seconds)

    loop.call_soon_threadsafe(loop.add_reader, r.fileno(), stall)
    time.sleep(0.02)
    w.send(b"x")
    w.close()
    time.sleep(0.1)  # blocked now
    return r


def read_all(s: socket.socket, timeout_s: float = 10.0) -> bytes:
    s.settimeout(timeout_s)
    got = bytearray()
    while chunk := s.recv(1 << 16):
        got += chunk
    return bytes(got)


def test_a_request_sent_in_time_is_answered_though_the_servers_loop_fell_behind(served):
    """The header deadline measures the client: its request reached our socket 0.1 s after it
    connected, but the server's loop was blocked 1.5 s (deadline 1 s) and uvloop runs due timers
    before it polls sockets. Before: closed unread, the client got a reset and no answer."""
    c = socket.create_connection(("127.0.0.1", served.port))
    try:
        wait_until(lambda: served.server.server_state.connections)  # accepted: its deadline runs
        stalled = stall_server_loop_in_io(served, 1.5)
        c.sendall(request_bytes(completion([5, 6], 4)))
        head, body = dechunk(read_all(c))
        stalled.close()
    finally:
        c.close()
    assert head.startswith(b"HTTP/1.1 200"), head
    assert sse_tokens(body) == (4, [], True)
    assert served.header_deadlines() == {"moved_bytes_unread": 1.0}


def test_a_408_read_late_is_whole_after_the_linger(served):
    """Refused, the connection closes lingering, then on our side for good: a client that reads
    the 408 long after it came still gets it whole, then the end of the stream."""
    body = completion([5, 6], 2, stream=False)
    c = socket.create_connection(("127.0.0.1", served.port))
    try:
        c.sendall(request_bytes(body)[:30])  # headers begun, never finished
        time.sleep(LIMITS.header_timeout_s * 3)  # the 408 came, the linger ended; not read yet
        assert not served.server.server_state.connections  # closed on our side meanwhile
        head, answer = dechunk(read_all(c))
    finally:
        c.close()
    assert head.startswith(b"HTTP/1.1 408") and json.loads(answer)["error"]["code"] == "header_timeout", head
    assert served.header_deadlines() == {"answered_408": 1.0}


def test_a_stalled_reader_is_cut_and_aborted_while_others_stream(served):
    backend = served.backend
    stalled = stalled_reader(served.port, completion([9, 9], 500_000))  # a long stream, never read
    held = 0  # the most bytes the server held unsent for it

    def cut() -> bool:
        nonlocal held
        conns = list(served.server.server_state.connections)
        held = max([held] + [c.transport.get_write_buffer_size() for c in conns])
        return not conns

    try:
        t0 = time.monotonic()
        took = asyncio.run(others_stream(served.port))  # meanwhile others stream normally
        assert took < 10, f"other streams took {took:.1f}s beside a stalled reader"
        wait_until(lambda: backend.aborted)
        aborted_after = time.monotonic() - t0
        (rid,) = backend.aborted
        wait_until(cut)
        cut_after = time.monotonic() - t0
        assert len(backend.started) == 9 and len(backend.finished) == 8
        assert served.gw.in_flight == 0
        assert served.cuts() == {"buffer_full": 1.0, "write_timeout": 1.0}
        # all the gateway ever got for it: the kernel's socket buffers, the transport's 64 KiB
        # high-water mark and max_stream_buffer outputs, not its 500k tokens
        assert backend.produced[rid] < 2000, backend.produced[rid]
        assert held <= 64 * 2**10 + 1024, held
        assert cut_after < LIMITS.stream_write_timeout_s + 4, cut_after
        # the connection was aborted: the client gets what its kernel held, then a reset or EOF
        stalled.settimeout(5)
        received = 0
        with contextlib.suppress(ConnectionResetError):
            while chunk := stalled.recv(1 << 16):
                received += len(chunk)
        print(
            f"stalled reader: aborted upstream after {aborted_after:.2f}s ({backend.produced[rid]} outputs "
            f"produced), connection cut after {cut_after:.2f}s ({received} bytes reached it, {held} held "
            f"unsent); others took {took:.2f}s"
        )
    finally:
        stalled.close()


def test_a_finished_response_left_unread_is_not_held_open(served):
    """Its tail sits in the gateway's buffer once the response ends; a close would wait on it forever."""
    stalled = stalled_reader(served.port, completion([9, 9], 450))  # ~75 KB: over the kernel's buffers,
    try:  # under the transport's 64 KiB mark
        wait_until(lambda: served.backend.finished)
        t0 = time.monotonic()
        wait_until(lambda: not served.server.server_state.connections)
        print(f"unread tail: connection cut {time.monotonic() - t0:.2f}s after the response ended")
        assert served.cuts() == {"write_timeout": 1.0} and served.backend.aborted == []
    finally:
        stalled.close()


def test_a_reader_that_falls_behind_then_reads_gets_an_error_event(tokenizer):
    """Cut for its buffer, not yet for the write timeout: the client reads on and is told why."""
    with serving(tokenizer, GatewayLimits(max_stream_buffer=64, stream_write_timeout_s=5.0)) as served:
        s = stalled_reader(served.port, completion([9, 9], 500_000))
        try:
            wait_until(lambda: served.backend.aborted)  # fell max_stream_buffer outputs behind
            s.settimeout(10)
            raw = bytearray()
            while chunk := s.recv(1 << 16):
                raw += chunk
        finally:
            s.close()
        head, body = dechunk(bytes(raw))
        tokens, errors, done = sse_tokens(body)
        assert head.startswith(b"HTTP/1.1 200") and done and 0 < tokens < 2000
        assert [e["message"] for e in errors] == ["stream cut: the client read too slowly (64 outputs waiting)"]
        assert served.cuts() == {"buffer_full": 1.0}


def test_slow_header_and_slow_body_clients_block_no_one_and_are_answered(served):
    port = served.port
    body = completion([5, 6], 2, stream=False)
    head = request_bytes(body)[: -len(body)]

    async def go():
        clients = {
            "silent": exchange(port, b""),
            "partial headers": exchange(port, head[:30]),
            "dribbled headers": exchange(port, head[:10], dribble=head[10:], every_s=0.05),
            "headers too large": exchange(port, head[:-2] + b"X-Pad: " + b"a" * 10_000 + b"\r\n\r\n" + body),
            "endless header": exchange(port, head[:-2] + b"X-Pad: " + b"a" * 20_000),  # and never its end
            "partial body": exchange(port, head + body[:5]),
            "dribbled body": exchange(port, head, dribble=body, every_s=0.05),
        }
        tasks = {k: asyncio.create_task(c) for k, c in clients.items()}
        took = await others_stream(port)
        return took, {k: await t for k, t in tasks.items()}

    took, answers = asyncio.run(go())
    assert took < 5, f"other streams took {took:.1f}s beside slow clients"
    expected = {
        "silent": None,
        "partial headers": (408, "header_timeout"),
        "dribbled headers": (408, "header_timeout"),
        "headers too large": (431, "headers_too_large"),
        "endless header": (431, "headers_too_large"),
        "partial body": (408, "body_timeout"),
        "dribbled body": (408, "body_timeout"),
    }
    for name, (raw, seconds) in answers.items():
        status = expected[name]
        if status is None:
            assert raw == b"", raw  # closed without an answer: it asked nothing
        else:
            h, b = dechunk(raw)
            assert h.startswith(b"HTTP/1.1 %d" % status[0]) and json.loads(b)["error"]["code"] == status[1], (name, raw)
        limit = LIMITS.header_timeout_s if "header" in name or name == "silent" else LIMITS.body_read_timeout_s
        assert seconds < limit + 2, (name, seconds)  # answered, and closed, on time
        print(f"{name}: {status} and closed after {seconds:.2f}s")
    wait_until(lambda: served.gw.in_flight == 0 and not served.server.server_state.connections)


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_body_at_the_limit_is_read_and_one_byte_over_is_413(served, chunked):
    prefix = json.dumps({"prompt": [5, 6], "max_tokens": 2})
    at_limit = prefix[:-1] + " " * (LIMITS.max_body_bytes - len(prefix)) + "}"
    assert len(at_limit) == LIMITS.max_body_bytes

    def post(body: str) -> httpx.Response:
        content = iter([body.encode()]) if chunked else body.encode()  # an iterator: chunked encoding
        return httpx.post(
            f"{served.base}/v1/completions", content=content, headers={"content-type": "application/json"}, timeout=10
        )

    ok, over = post(at_limit), post(at_limit + " ")
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["text"] and ok.json()["usage"]["completion_tokens"] == 2
    assert over.status_code == 413 and over.json()["error"]["code"] == "body_too_large", over.text
