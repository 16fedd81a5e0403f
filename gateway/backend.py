"""What the HTTP layer needs from whatever serves tokens: `open` a request onto an OutputStream
(the cluster, or a stub in tests, which implements the same call)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from pdserve.gateway.output_stream import OutputStream
from pdserve.gateway.queue_stats import QueueStats
from pdserve.protocol.join import JoinAnswer
from pdserve.protocol.messages import WorkerStats
from pdserve.protocol.sampling import SamplingParams


class BackendUnavailable(Exception):
    """No capacity now: the gateway answers `status` (503, or 429 for a full queue) with
    Retry-After, before any token."""

    status = 503
    code = "unavailable"

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class RequestTooLarge(BackendUnavailable):
    """The request can never fit (e.g. a group's sequences at full length exceed every worker's
    KV pool): 400 before any work, not a retry."""

    status = 400
    code = "request_too_large"

    def __init__(self, message: str) -> None:
        super().__init__(message, retry_after_s=0.0)


class Backend(ABC):
    """What the HTTP layer calls: production's ClusterBackend and the tests' stubs alike."""

    @abstractmethod
    def open(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, stream: OutputStream
    ) -> None:
        """Start the request: its outputs go onto `stream` in token order, then `stream.end()`
        (with BackendUnavailable when refused before any token, or another error). The reader
        closing the stream (or a cut) aborts it (`stream.on_abort`; `stream.upstream` is the task
        `aclose` waits for, if any). Called in the request's context (its priority and trace
        context variables set)."""

    def stop_choice(self, request_id: str, index: int) -> None:
        """One choice of a group whose choices stream ended here (a stop string): let the worker
        stop generating it; the request's other choices go on. Best effort: tokens it still sends
        for that choice are dropped."""

    @abstractmethod
    def health(self) -> tuple[bool, dict]: ...

    @abstractmethod
    def worker_stats(self) -> dict[str, WorkerStats]: ...

    def queue_stats(self) -> dict[str, QueueStats]:
        """Requests (and their prompt tokens) waiting per pool, for /metrics."""
        return {}

    def collectors(self) -> list:
        """Extra Prometheus collectors the backend keeps (registered with the app's registry)."""
        return []

    def routed_requests(self) -> dict[str, int]:
        """Requests this gateway has routed to each worker and not yet seen end: its own count,
        current at every call (worker stats lag by up to a heartbeat)."""
        return {}

    def workers(self) -> list[dict]:
        """Every worker known, as `GET /v1/workers` lists them."""
        return []

    def join(self, body: bytes, url_host: str) -> JoinAnswer | None:
        """Answer a worker's `POST /cluster/join` (protocol/join.py), raising JoinRefused; None
        when this backend has no worker plane to join."""
        return None
