"""A worker's probe endpoints (Kubernetes liveness and readiness), on a thread of their own.

    GET /health/live   200 while the engine loop makes progress (a step pending for longer
                       than `stuck_after_s` means stuck: 503, restart it)
    GET /health/ready  200 once a gateway has welcomed the worker and while it is not draining
                       (503 otherwise: take it out of a Service, do not count it as available)

Both answer JSON with the state they judged. Workers take requests from the gateway over ZeroMQ,
not over HTTP: this server only reports. It binds a named interface (the pod's IP in the
manifests); wildcard hosts are refused like every other bind in pdserve.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pdserve.protocol.channel import check_bind_address

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerHealth:
    welcomed: bool  # a gateway answered our registration
    draining: bool
    last_step_age_s: float  # how long a pending engine step has gone without completing (0: idle)
    stuck_after_s: float

    @property
    def live(self) -> bool:
        return self.last_step_age_s <= self.stuck_after_s

    @property
    def ready(self) -> bool:
        return self.live and self.welcomed and not self.draining


def parse_host_port(bind: str) -> tuple[str, int]:
    host, sep, port = bind.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"health bind must be HOST:PORT, got {bind!r}")
    host = host.strip("[]")
    check_bind_address(f"tcp://{host}:{port}")
    return host, int(port)


class HealthServer:
    def __init__(self, bind: str, state: Callable[[], WorkerHealth]) -> None:
        host, port = parse_host_port(bind)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                health = state()
                ok = {"/health/live": health.live, "/health/ready": health.ready}.get(self.path)
                if ok is None:
                    self.send_error(404)
                    return
                body = json.dumps({**asdict(health), "live": health.live, "ready": health.ready}).encode()
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:  # probes every few seconds: not worth a log line
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="health", daemon=True)
        self._thread.start()
        log.info("health endpoints on http://%s:%d/health/{live,ready}", host, self.port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
