"""Typed, authenticated ZMQ channels: PULL inboxes and PUSH outboxes of protocol messages.

    Outbox (PUSH, connect) --[mac, header, *payloads]--> Inbox (PULL, bind)

Receiving: every message is verified (FrameAuth) before its header is decoded (msgspec, typed,
unknown tags rejected). Anything that fails is dropped and counted in `dropped[reason]`
("auth", "decode"); an inbox never raises on bad input and keeps serving.

Sending is non-blocking: a bounded SNDHWM caps the queue per peer, and `send` returns False
instead of blocking when it is full (or after `timeout_ms` when one is given); the caller decides
(drop, retry, fail the request). Sockets close with linger 0: a dying process never hangs on
undelivered messages.

Encryption: a tcp:// channel is encrypted with CURVE unless the cluster turns it off
(protocol/plane_encryption.py; `FrameAuth.secure_bind` / `secure_connect`).

Binding defaults to loopback (tcp://127.0.0.1:0 = any free port; `.addr` is the resolved
address); ipc:// and inproc:// work too. Wildcard binds (tcp://*, 0.0.0.0, ::) are refused unless
`allow_wildcard=True`. Sockets are not thread-safe: one owner thread per channel.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from pdserve.protocol.auth import AuthError, FrameAuth
from pdserve.protocol.messages import Message, decode, encode

log = logging.getLogger(__name__)

DEFAULT_BIND = "tcp://127.0.0.1:0"
SEND_HWM = 10_000  # messages queued per peer before send() reports "full"

_WILDCARD_HOSTS = {"*", "0.0.0.0", "::", "[::]", "", "[*]"}


def is_wildcard_host(host: str | None) -> bool:
    """All interfaces (tcp://*, 0.0.0.0, ::), as a bind's host part."""
    return (host or "").strip().lower() in _WILDCARD_HOSTS


def check_bind_address(addr: str, allow_wildcard: bool = False) -> None:
    """Raise ValueError for a wildcard tcp bind (all interfaces) unless explicitly allowed."""
    scheme, sep, rest = addr.partition("://")
    if not sep:
        raise ValueError(f"bad ZMQ address {addr!r}: expected tcp://host:port, ipc://path or inproc://name")
    if scheme != "tcp" or allow_wildcard:
        return
    # tcp://[source;]host:port ; host may be an IPv6 literal in brackets
    host = rest.rsplit(";", 1)[-1].rpartition(":")[0]
    if is_wildcard_host(host):
        raise ValueError(
            f"refusing wildcard bind {addr!r}: bind a specific interface "
            "(127.0.0.1 by default) or pass allow_wildcard=True"
        )


def bind_socket(sock: zmq.Socket, addr: str | None, allow_wildcard: bool = False) -> str:
    """Bind (loopback, any port when addr is None) and return the resolved endpoint."""
    addr = addr or DEFAULT_BIND
    check_bind_address(addr, allow_wildcard)
    sock.bind(addr)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


Decoder = Callable[[bytes], Any]


class _InboxBase:
    def __init__(
        self,
        sock: zmq.Socket,
        auth: FrameAuth,
        bind_addr: str | None,
        allow_wildcard: bool,
        decoder: Decoder,
        max_message_bytes: int,
    ) -> None:
        self.socket = sock
        self.auth = auth
        self._decode = decoder
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        if max_message_bytes > 0:
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)  # peers exceeding it are disconnected
        try:
            auth.secure_bind(sock, bind_addr or DEFAULT_BIND)
            self.addr = bind_socket(sock, bind_addr, allow_wildcard)
        except BaseException:
            sock.close(linger=0)
            raise
        self.dropped: collections.Counter[str] = collections.Counter()
        self.received = 0

    def drop(self, reason: str, detail: object = "") -> None:
        """Count a dropped message; log the 1st, 2nd, 4th, 8th ... of each reason (a flood of
        garbage must not flood the log)."""
        self.dropped[reason] += 1
        n = self.dropped[reason]
        if n & (n - 1) == 0:
            log.warning("dropped message on %s (%s, %d so far): %s", self.addr, reason, n, detail)

    def _parse(self, frames: Sequence) -> tuple[Any, list[memoryview]] | None:
        try:
            header, payloads = self.auth.verify(frames)
        except AuthError as e:
            self.drop("auth", e)
            return None
        try:
            msg = self._decode(header)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.drop("decode", e)
            return None
        except Exception as e:  # a decoder must never take the receiver down
            self.drop("decode", repr(e))
            return None
        self.received += 1
        return msg, payloads

    @property
    def closed(self) -> bool:
        return self.socket.closed

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` > 0 gives messages still queued that long to go out."""
        if not self.socket.closed:
            self.socket.close(linger=linger_ms)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _remaining_ms(deadline: float | None) -> int | None:
    if deadline is None:
        return None
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))  # rounded up: never a busy poll(0)


class Inbox(_InboxBase):
    """PULL socket bound at `bind_addr`; yields valid messages, drops and counts the rest.

    `timeout_ms`: None blocks until a valid message arrives, 0 returns at once."""

    def __init__(
        self,
        ctx: zmq.Context,
        auth: FrameAuth,
        bind_addr: str | None = DEFAULT_BIND,
        allow_wildcard: bool = False,
        *,
        decoder: Decoder = decode,
        max_message_bytes: int = -1,
    ) -> None:
        super().__init__(ctx.socket(zmq.PULL), auth, bind_addr, allow_wildcard, decoder, max_message_bytes)

    def poll(self, timeout_ms: int | None = 0) -> bool:
        """True when a message (valid or not) is waiting."""
        return bool(self.socket.poll(timeout_ms, zmq.POLLIN))

    def recv_raw(self, timeout_ms: int | None = 0) -> tuple[Any, list[memoryview]] | None:
        """Next valid (message, payload buffers), or None when none arrived within the timeout."""
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while self.socket.poll(_remaining_ms(deadline), zmq.POLLIN):
            parsed = self._parse(self.socket.recv_multipart(copy=False))
            if parsed is not None:
                return parsed
        return None

    def recv_one(self, timeout_ms: int | None = 0) -> Message | None:
        parsed = self.recv_raw(timeout_ms)
        return parsed[0] if parsed else None

    def recv(self, timeout_ms: int | None = 0, max_messages: int = 1000) -> list[Message]:
        """Everything waiting (up to max_messages); waits up to timeout_ms for the first one."""
        out: list[Message] = []
        msg = self.recv_one(timeout_ms)
        while msg is not None:
            out.append(msg)
            if len(out) >= max_messages:
                break
            msg = self.recv_one(0)
        return out


class AsyncInbox(_InboxBase):
    """Inbox for asyncio code (zmq.asyncio context). `timeout_ms=None` waits for a valid message."""

    socket: zmq.asyncio.Socket

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        auth: FrameAuth,
        bind_addr: str | None = DEFAULT_BIND,
        allow_wildcard: bool = False,
        *,
        decoder: Decoder = decode,
        max_message_bytes: int = -1,
    ) -> None:
        super().__init__(ctx.socket(zmq.PULL), auth, bind_addr, allow_wildcard, decoder, max_message_bytes)

    async def poll(self, timeout_ms: int | None = 0) -> bool:
        return bool(await self.socket.poll(timeout_ms))  # POLLIN, the default (pyzmq's stub has no flags)

    async def recv_raw(self, timeout_ms: int | None = None) -> tuple[Any, list[memoryview]] | None:
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        while await self.socket.poll(_remaining_ms(deadline)):  # POLLIN
            parsed = self._parse(await self.socket.recv_multipart(copy=False))
            if parsed is not None:
                return parsed
        return None

    async def recv_one(self, timeout_ms: int | None = None) -> Message | None:
        parsed = await self.recv_raw(timeout_ms)
        return parsed[0] if parsed else None

    async def recv(self, timeout_ms: int | None = 0, max_messages: int = 1000) -> list[Message]:
        out: list[Message] = []
        msg = await self.recv_one(timeout_ms)
        while msg is not None:
            out.append(msg)
            if len(out) >= max_messages:
                break
            msg = await self.recv_one(0)
        return out


class _OutboxBase:
    def __init__(self, sock: zmq.Socket, auth: FrameAuth, connect_addr: str, sndhwm: int) -> None:
        try:
            sock.setsockopt(zmq.SNDHWM, sndhwm)
            sock.setsockopt(zmq.LINGER, 0)
            auth.secure_connect(sock, connect_addr)
            sock.connect(connect_addr)
        except BaseException:
            sock.close(linger=0)
            raise
        self.socket = sock
        self.auth = auth
        self.addr = connect_addr
        self.full = 0  # sends refused because the queue was full

    def _frames(self, msg: Any, payloads: Sequence) -> list:
        return self.auth.sign(encode(msg), payloads)

    def _try_send(self, frames: list, copy: bool) -> bool:
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy)
            return True
        except zmq.Again:
            return False

    def _refused(self, msg: Any) -> bool:
        self.full += 1
        log.warning("send queue to %s full; not sent: %s", self.addr, type(msg).__name__)
        return False

    @property
    def closed(self) -> bool:
        return self.socket.closed

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` > 0 gives messages still queued that long to go out."""
        if not self.socket.closed:
            self.socket.close(linger=linger_ms)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Outbox(_OutboxBase):
    """PUSH socket connected to `connect_addr`.

    `send` never blocks longer than `timeout_ms` (0: not at all) and returns False when the
    message could not be queued. Payloads are sent zero-copy (`copy=False`): pyzmq keeps each
    payload object alive until libzmq is done with it, so do not modify them in place after."""

    def __init__(self, ctx: zmq.Context, auth: FrameAuth, connect_addr: str, *, sndhwm: int = SEND_HWM) -> None:
        super().__init__(ctx.socket(zmq.PUSH), auth, connect_addr, sndhwm)

    def send(self, msg: Any, payloads: Sequence = (), timeout_ms: int = 0) -> bool:
        return self._send(msg, payloads, timeout_ms, track=False) is not None

    def send_tracked(self, msg: Any, payloads: Sequence, timeout_ms: int = 0) -> zmq.MessageTracker | None:
        """Zero-copy send that reports (MessageTracker.done) when ZMQ no longer needs the payload
        buffers, so the caller may reuse them; None when the queue stayed full."""
        if not payloads:
            raise ValueError("send_tracked needs payload frames to track")
        return self._send(msg, payloads, timeout_ms, track=True)

    def _send(self, msg: Any, payloads: Sequence, timeout_ms: int, track: bool):
        frames = self._frames(msg, payloads)
        copy = not payloads
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            try:
                sent = self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=copy, track=track and not copy)
                return sent if track and not copy else True
            except zmq.Again:
                pass
            if timeout_ms <= 0 or time.monotonic() >= deadline:
                break
            if not self.socket.poll(_remaining_ms(deadline), zmq.POLLOUT):
                break
        self._refused(msg)
        return None


class AsyncOutbox(_OutboxBase):
    """Outbox for asyncio code. `send` is synchronous and non-blocking (safe to call from a
    callback, never an un-awaited future: the socket lives on a sync shadow of the asyncio
    context); `await send_async(..., timeout_ms)` waits for room without blocking the loop."""

    def __init__(self, ctx: zmq.asyncio.Context, auth: FrameAuth, connect_addr: str, *, sndhwm: int = SEND_HWM) -> None:
        super().__init__(zmq.Context.shadow(ctx).socket(zmq.PUSH), auth, connect_addr, sndhwm)

    def send(self, msg: Any, payloads: Sequence = ()) -> bool:
        if self._try_send(self._frames(msg, payloads), copy=not payloads):
            return True
        return self._refused(msg)

    async def send_async(self, msg: Any, payloads: Sequence = (), timeout_ms: int = 0) -> bool:
        frames = self._frames(msg, payloads)
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            if self._try_send(frames, copy=not payloads):
                return True
            if time.monotonic() >= deadline:
                return self._refused(msg)
            await asyncio.sleep(0.005)  # sync socket: poll for room without blocking the loop
