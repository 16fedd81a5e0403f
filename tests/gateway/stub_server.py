"""The gateway over a counting stub backend under uvicorn, in a process of its own, as users run
it: `python -m tests.gateway.stub_server TOKENIZER_DIR LISTEN_FD [HOLD_UNTIL]`. It serves on the
listening socket it inherits (each stream's first token held until HOLD_UNTIL requests have
started, or 30 s: all at once for sure), prints `ready`, and answers each `stats` line on stdin with one JSON line
(requests started/finished/aborted, in flight now and at peak, open connections, RSS growth);
stdin closed: it stops."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
from collections import Counter

import uvicorn
from transformers import AutoTokenizer

from pdserve.gateway.app import create_app
from pdserve.gateway.slow_clients import http_protocol
from tests.gateway.stub_backend import StubBackend


class CountingBackend(StubBackend):
    """The stub backend, counting the outputs it produced per request."""

    def __init__(self, hold_until: int = 0) -> None:
        super().__init__()
        self.produced: Counter[str] = Counter()
        self.delay_s = 0.001  # streams overlap
        self.hold_until = hold_until
        self._arrived = 0
        self._all_started: asyncio.Event | None = None

    async def outputs(self, request_id, prompt_token_ids, sampling):
        async with contextlib.aclosing(super().outputs(request_id, prompt_token_ids, sampling)) as gen:
            if self.hold_until:
                await self._hold(request_id)
            async for out in gen:
                self.produced[request_id] += 1
                yield out

    async def _hold(self, request_id: str) -> None:
        if self._all_started is None:
            self._all_started = asyncio.Event()
        self._arrived += 1
        if self._arrived >= self.hold_until:
            self._all_started.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_started.wait(), 30)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main(tokenizer_dir: str, listen_fd: int, hold_until: int) -> None:
    backend = CountingBackend(hold_until)
    app = create_app(backend, AutoTokenizer.from_pretrained(tokenizer_dir), model_name="m", max_model_len=10**6)
    gw = app.state.gateway
    http = http_protocol(gw.limits, gw.stream_cut, gw.header_deadline)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", http=http))  # type: ignore[arg-type]
    sock = socket.socket(fileno=listen_fd)
    base_rss = rss_bytes()
    peak = {"in_flight": 0, "rss": base_rss}

    def sample() -> None:
        while not server.should_exit:
            peak["in_flight"] = max(peak["in_flight"], gw.in_flight)
            peak["rss"] = max(peak["rss"], rss_bytes())
            time.sleep(0.02)

    def commands() -> None:
        for line in sys.stdin:
            if line.strip() == "stats":
                stats = {
                    "started": len(backend.started),
                    "finished": len(backend.finished),
                    "aborted": len(backend.aborted),
                    "in_flight": gw.in_flight,
                    "peak_in_flight": peak["in_flight"],
                    "connections": len(server.server_state.connections),
                    "rss_growth_mib": (peak["rss"] - base_rss) / 2**20,
                    "header_deadlines": {
                        s.labels["outcome"]: s.value
                        for m in gw.metrics.header_deadlines.collect()
                        for s in m.samples
                        if s.name.endswith("_total")
                    },
                }
                print(json.dumps(stats), flush=True)
        server.should_exit = True  # stdin closed: the test is done

    def announce() -> None:
        while not server.started:
            time.sleep(0.02)
        print("ready", flush=True)

    for job in (sample, commands, announce):
        threading.Thread(target=job, daemon=True).start()
    server.run(sockets=[sock])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 0)
