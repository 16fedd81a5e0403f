"""Typed, authenticated ZMQ channels: PULL inboxes and PUSH outboxes of protocol messages.

Anything that fails authentication or decoding is dropped and counted (`dropped[reason]`);
a receiver never raises on bad input and keeps serving. Binds default to loopback; wildcard
binds must be asked for explicitly.
"""
from __future__ import annotations

import collections
import logging
from collections.abc import Sequence

import msgspec
import zmq
import zmq.asyncio

from protocol.auth import AuthError, FrameAuth
from protocol.messages import Message, decode, encode

log = logging.getLogger(__name__)

SEND_HWM = 10_000


def check_bind_address(addr: str, allow_wildcard: bool = False) -> None:
    if not allow_wildcard and ("tcp://*" in addr or "0.0.0.0" in addr or "tcp://[::]" in addr):
        raise ValueError(f"refusing wildcard bind {addr!r}: bind a specific interface "
                         "(loopback by default) or pass allow_wildcard=True")


def _bind(sock: zmq.Socket, addr: str, allow_wildcard: bool) -> str:
    check_bind_address(addr, allow_wildcard)
    sock.bind(addr)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class _InboxBase:
    def __init__(self, sock: zmq.Socket, auth: FrameAuth, bind_addr: str, allow_wildcard: bool) -> None:
        self.socket = sock
        self.auth = auth
        self.addr = _bind(sock, bind_addr, allow_wildcard)
        self.dropped: collections.Counter[str] = collections.Counter()

    def _parse(self, frames: Sequence) -> tuple[Message, list] | None:
        try:
            header, payloads = self.auth.verify(frames)
            return decode(header), payloads
        except AuthError as e:
            self.dropped["auth"] += 1
            log.warning("dropped unauthenticated frame on %s: %s", self.addr, e)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.dropped["decode"] += 1
            log.warning("dropped undecodable message on %s: %s", self.addr, e)
        return None

    def close(self) -> None:
        self.socket.close(linger=0)


class Inbox(_InboxBase):
    def __init__(self, ctx: zmq.Context, auth: FrameAuth, bind_addr: str, allow_wildcard: bool = False) -> None:
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        super().__init__(sock, auth, bind_addr, allow_wildcard)

    def recv_raw(self, timeout_ms: int | None = 0) -> tuple[Message, list] | None:
        """Next valid (message, payload frames), or None when nothing valid arrived in time."""
        while self.socket.poll(timeout_ms):
            parsed = self._parse(self.socket.recv_multipart(copy=False))
            if parsed is not None:
                return parsed
            timeout_ms = 0
        return None

    def recv_one(self, timeout_ms: int | None = 0) -> Message | None:
        parsed = self.recv_raw(timeout_ms)
        return parsed[0] if parsed else None


class AsyncInbox(_InboxBase):
    def __init__(self, ctx: zmq.asyncio.Context, auth: FrameAuth, bind_addr: str,
                 allow_wildcard: bool = False) -> None:
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, 0)
        super().__init__(sock, auth, bind_addr, allow_wildcard)

    async def recv_one(self) -> Message | None:
        parsed = self._parse(await self.socket.recv_multipart(copy=False))
        return parsed[0] if parsed else None


class _OutboxBase:
    def __init__(self, sock: zmq.Socket, auth: FrameAuth, connect_addr: str) -> None:
        sock.setsockopt(zmq.SNDHWM, SEND_HWM)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(connect_addr)
        self.socket = sock
        self.auth = auth
        self.addr = connect_addr

    def send(self, msg: Message, payloads: Sequence = ()) -> bool:
        """Queue a message without blocking; False if the peer's queue is full (caller decides)."""
        frames = self.auth.sign(encode(msg), payloads)
        try:
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return True
        except zmq.Again:
            log.warning("send queue to %s full; dropped %s", self.addr, type(msg).__name__)
            return False

    def send_tracked(self, msg: Message, payloads: Sequence) -> zmq.MessageTracker:
        """Zero-copy send that reports when ZMQ no longer needs the payload buffers (blocks
        while the peer's queue is full: KV frames must not be dropped)."""
        frames = self.auth.sign(encode(msg), payloads)
        return self.socket.send_multipart(frames, copy=False, track=True)

    def close(self) -> None:
        self.socket.close(linger=0)


class Outbox(_OutboxBase):
    def __init__(self, ctx: zmq.Context, auth: FrameAuth, connect_addr: str) -> None:
        super().__init__(ctx.socket(zmq.PUSH), auth, connect_addr)


class AsyncOutbox(_OutboxBase):
    """An Outbox for asyncio code: a plain socket on a sync shadow of the asyncio context, so
    `send` stays synchronous and non-blocking (never an un-awaited future)."""

    def __init__(self, ctx: zmq.asyncio.Context, auth: FrameAuth, connect_addr: str) -> None:
        super().__init__(zmq.Context.shadow(ctx).socket(zmq.PUSH), auth, connect_addr)
