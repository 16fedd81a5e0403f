"""The gateway's sockets to its workers: one authenticated PULL inbox every worker sends to, one
PUSH outbox per worker, and the loop that hands each message received to `dispatch`.

A message that fails in `dispatch` is logged and dropped; the loop goes on (one bad message must
not stop the gateway). Frames that fail authentication or decoding never reach it (counted in
`inbox.dropped`, protocol/channel.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from pdserve.protocol.auth import FrameAuth
from pdserve.protocol.channel import AsyncInbox, AsyncOutbox
from pdserve.protocol.messages import Message, decode_to_gateway

log = logging.getLogger(__name__)


class WorkerPlane:
    def __init__(self, auth: FrameAuth, bind: str, allow_wildcard: bool = False) -> None:
        self.auth, self.bind, self.allow_wildcard = auth, bind, allow_wildcard
        self._ctx: zmq.asyncio.Context | None = None
        self.inbox: AsyncInbox | None = None
        self._outboxes: dict[str, AsyncOutbox] = {}
        self._task: asyncio.Task | None = None

    def start(self, dispatch: Callable[[Message], None]) -> None:
        self._ctx = zmq.asyncio.Context()
        self.inbox = AsyncInbox(
            self._ctx, self.auth, self.bind, allow_wildcard=self.allow_wildcard, decoder=decode_to_gateway
        )
        self._task = asyncio.create_task(self._receive_loop(self.inbox, dispatch))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for box in self._outboxes.values():
            box.close()
        self._outboxes.clear()
        if self.inbox is not None:
            self.inbox.close()
        if self._ctx is not None:
            self._ctx.term()

    @property
    def addr(self) -> str:
        assert self.inbox is not None
        return self.inbox.addr

    async def _receive_loop(self, inbox: AsyncInbox, dispatch: Callable[[Message], None]) -> None:
        while True:
            msg = await inbox.recv_one()
            if msg is None:
                continue
            try:
                dispatch(msg)
            except Exception:
                log.exception("error handling %s", type(msg).__name__)

    # --- outboxes ---------------------------------------------------------------------------
    def connected(self, worker_id: str) -> bool:
        return worker_id in self._outboxes

    def connect(self, worker_id: str, control_addr: str) -> None:
        assert self._ctx is not None
        self.disconnect(worker_id)
        self._outboxes[worker_id] = AsyncOutbox(self._ctx, self.auth, control_addr)

    def disconnect(self, worker_id: str) -> None:
        box = self._outboxes.pop(worker_id, None)
        if box is not None:
            box.close()

    def send(self, worker_id: str, msg: Message) -> bool:
        box = self._outboxes.get(worker_id)
        return box is not None and box.send(msg)

    def dropped_frames(self) -> int:
        return sum(self.inbox.dropped.values()) if self.inbox is not None else 0
