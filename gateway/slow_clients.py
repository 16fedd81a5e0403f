"""Clients that read too slowly: a stalled reader must not hold memory or a stream open.

Two bounds, both per request:
- `GatewayLimits.max_stream_buffer` outputs may wait in the gateway for a client that reads
  slower than tokens come (the HTTP writer blocks on TCP flow control and stops draining them);
  past it the request is aborted upstream, so its KV blocks come back at once, and the client
  gets an error event if it ever reads again (gateway/generation.py `GenerationRun._pump`).
- `WriteTimeout`: one response write that waits on the client for `stream_write_timeout_s`
  ends the response; uvicorn then closes the connection, and the stream's own cleanup aborts
  whatever is still upstream.
Each cut is counted in `pdserve_streams_cut_total{reason}` and logged in one line.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class _ClientStalled(Exception):
    pass


def _is_stall(exc: BaseException) -> bool:
    """The stall itself, or an exception group (Starlette's task groups) holding it."""
    return isinstance(exc, _ClientStalled) or any(_is_stall(e) for e in getattr(exc, "exceptions", ()))


class WriteTimeout:
    """Pure ASGI: a response body write blocked longer than `timeout_s` on a client that does
    not read ends the response (`on_cut("write_timeout")` is called)."""

    def __init__(self, app, timeout_s: float, on_cut: Callable[[str], None]) -> None:
        self.app, self.timeout_s, self.on_cut = app, timeout_s, on_cut

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def timed_send(message) -> None:
            if message["type"] != "http.response.body":
                return await send(message)
            try:
                await asyncio.wait_for(send(message), self.timeout_s)
            except asyncio.TimeoutError:
                raise _ClientStalled from None

        try:
            await self.app(scope, receive, timed_send)
        except Exception as e:
            if not _is_stall(e):
                raise
            self.on_cut("write_timeout")
            client = scope.get("client") or ("?", 0)
            log.warning("cut the stream to %s:%s %s: the client read nothing for %g s", client[0], client[1],
                        scope.get("path", ""), self.timeout_s)
