"""Slow clients: a client that stalls, on either side of its connection, holds nothing for long
and blocks no one (asyncio: every connection is its own set of callbacks).

- Reading too slowly: at most `GatewayLimits.max_stream_buffer` outputs wait in the gateway for
  a stream's client (the HTTP writer blocks on TCP flow control and stops draining them); past it
  the request is aborted upstream, so its KV blocks come back at once, and the client gets an
  error event if it ever reads again (gateway/output_stream.py `OutputStream.push`).
- Not reading at all: a connection whose writes stay paused on flow control (or whose last
  bytes stay unsent) for `stream_write_timeout_s` is aborted (`SlowClientProtocol`). The request
  then ends as for any client gone: the stream's cleanup closes its backend streams, which
  aborts it on the workers. An abort, not a close: a close waits for the unread bytes to be
  sent, which for such a client is forever (the fd and buffers with it).
- Sending too slowly: headers not complete `header_timeout_s` after the connection opened or the
  request began get a 408 (a connection that sent nothing at all is closed), more than
  `max_header_bytes` of them a 431 (uvicorn has neither under httptools); a body not received
  whole within `body_read_timeout_s` gets a 408 (gateway/app.py).
  The deadline measures the client, not this event loop: when it fires while the client's bytes
  wait unread in our socket (the loop fell behind, as under a flood of connections on a busy
  core), they are read first and the deadline moves once by `header_timeout_s`.
  A refused connection closes lingering: our answer and FIN go out, what the client still sends
  is read and dropped until it closes or `header_timeout_s` passes, then a plain close. Not a
  reset (a close with bytes unread on our side, or an abort): a reset drops what is still on its
  way to the client, and some clients' kernels what it has not read yet.
Each cut of a reader is counted in `pdserve_streams_cut_total{reason}` and logged in one line;
each header deadline in `pdserve_header_deadlines_total{outcome}`.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import json
import logging
import struct
import termios
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdserve.gateway.limits import GatewayLimits

log = logging.getLogger(__name__)

_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class SlowClientProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with deadlines on the client: headers (408/431) and writes
    left unread (abort, `on_cut("write_timeout")`)."""

    def __init__(
        self,
        *args,
        limits: GatewayLimits,
        on_cut: Callable[[str], None],
        on_header_deadline: Callable[[str], None] = lambda outcome: None,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.limits, self.on_cut, self.on_header_deadline = limits, on_cut, on_header_deadline
        self._header_timer: asyncio.TimerHandle | None = None  # set while request headers are due
        self._header_deadline_moved = False  # moved once already for this request
        self._header_bytes = 0
        self._write_timer: asyncio.TimerHandle | None = None
        self._refused = False  # answered 408/431: what the client still sends is dropped

    # --- headers ------------------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm_header_timer()  # a connection that sends nothing is closed too

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        super().data_received(data)
        if self._header_timer is not None:  # the headers are still coming
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._refuse(431, f"request headers over {self.limits.max_header_bytes} bytes", "headers_too_large")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        if self._header_timer is None:  # on a kept-alive connection: from the request's first byte
            self._header_deadline_moved = False
            self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size <= self.limits.max_header_bytes:
            return super().on_headers_complete()
        app, self.app = self.app, self._headers_too_large  # this request only, the way uvicorn answers 503s
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    async def _headers_too_large(self, scope, receive, send) -> None:
        body = _envelope(f"request headers over {self.limits.max_header_bytes} bytes", "headers_too_large")
        await send(
            {
                "type": "http.response.start",
                "status": 431,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", b"%d" % len(body)),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_deadline)

    def _header_deadline(self) -> None:
        """The headers are late, unless the client's bytes are in our socket and this loop has not
        read them yet (uvloop runs due timers before it polls sockets): then move the deadline
        once, the read comes first."""
        self._header_timer = None
        if not self._header_deadline_moved and _bytes_unread(self.transport):
            self._header_deadline_moved = True
            self.on_header_deadline("moved_bytes_unread")
            self._arm_header_timer()
            return
        if self.scope is None:  # not a byte on this connection: nothing to answer
            self.on_header_deadline("closed_idle")
        else:
            self.on_header_deadline("answered_408")
        self._refuse(408, f"request headers not received within {self.limits.header_timeout_s:g} s", "header_timeout")

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer a request whose headers never came whole, then close lingering."""
        self._cancel_header_timer()
        self._refused = True
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.keep_alive = False  # a pipelined request: close once the response in progress ends
            return
        if self.scope is not None:  # else not a byte on this connection: nothing to answer
            body = _envelope(message, code)
            self.transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n%s" % (status, _REASONS[status], len(body), body)
            )
        self.transport.write_eof()  # our FIN after the answer; reading goes on (data_received drops it)
        self.loop.call_later(self.limits.header_timeout_s, self._end_linger)

    def _end_linger(self) -> None:
        """The client has neither closed nor read on for `header_timeout_s` after our answer."""
        if self.transport.is_closing():
            return
        if self.transport.get_write_buffer_size():  # it never took the answer: nothing to lose
            self.transport.abort()
        else:  # the kernel delivers what it holds, then FIN; nothing unread on our side: no reset
            self.transport.close()

    # --- writes the client leaves unread ------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        self._arm_write_timer()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.get_write_buffer_size():  # its last bytes must still reach the client
            self._arm_write_timer()

    def connection_lost(self, exc) -> None:
        self._cancel_header_timer()
        self._cancel_write_timer()
        super().connection_lost(exc)

    def _arm_write_timer(self) -> None:
        self._cancel_write_timer()
        self._write_timer = self.loop.call_later(self.limits.stream_write_timeout_s, self._write_stalled)

    def _cancel_write_timer(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_stalled(self) -> None:
        self._write_timer = None
        if not self.transport.get_write_buffer_size():
            return
        if not (self.flow.write_paused or self.transport.is_closing()):
            return self._arm_write_timer()  # a response's tail still going out: look again later
        self.on_cut("write_timeout")
        client = self.client or ("?", 0)
        path = self.scope.get("path", "") if self.scope else ""
        log.warning(
            "cut the connection of %s:%s (%s): it read nothing for %g s, %d bytes left unsent",
            client[0],
            client[1],
            path,
            self.limits.stream_write_timeout_s,
            self.transport.get_write_buffer_size(),
        )
        self.transport.abort()  # connection_lost: the request ends as for any client gone


def _bytes_unread(transport: asyncio.BaseTransport) -> int:
    """Bytes the client sent that wait in the kernel's receive queue of the transport's socket."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4))[0]
    except OSError:
        return 0


def _envelope(message: str, code: str) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    ).encode()


def http_protocol(
    limits: GatewayLimits,
    on_cut: Callable[[str], None],
    on_header_deadline: Callable[[str], None] = lambda outcome: None,
) -> Callable[..., SlowClientProtocol]:
    """The `http=` of a uvicorn.Config serving the gateway."""
    return functools.partial(SlowClientProtocol, limits=limits, on_cut=on_cut, on_header_deadline=on_header_deadline)
