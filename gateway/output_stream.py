"""One request's outputs on their way to its client: the one queue between whoever produces them
(the cluster's socket loop, in token order) and the HTTP response that writes them.

    producer: push(out) ... push(out) end()        consumer: await get() -> out ... None
                  |  over `limit` waiting: cut: on_cut() (the consumer's), on_abort() (the
                  |  producer's: stop upstream), StreamCut to the reader after what is queued
                  +  close() by the consumer: later pushes dropped, on_abort()

No task sits between the two: `push` appends and wakes the reader only when it is waiting.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from pdserve.protocol.messages import TokenOutput


class StreamCut(Exception):
    """A stream ended by the gateway because its client read too slowly."""


class OutputStream:
    __slots__ = ("_items", "_waiter", "_error", "_ended", "closed", "limit", "on_cut", "on_abort", "upstream")

    def __init__(self, limit: int = 1 << 30, on_cut: Callable[[], None] | None = None) -> None:
        self._items: deque[TokenOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None  # raised to the reader after what is queued
        self._ended = False  # no more outputs will come
        self.closed = False  # the reader left
        self.limit = limit  # outputs waiting before the stream is cut
        self.on_cut = on_cut  # the consumer's: count the cut
        self.on_abort: Callable[[], object] | None = None  # the producer's: stop (cut, or the reader left)
        self.upstream: asyncio.Task | None = None  # the producer's task, if any: `aclose` waits for it

    def __len__(self) -> int:
        return len(self._items)

    @property
    def done(self) -> bool:
        """Nothing more will be pushed (ended, cut or closed)."""
        return self._ended or self.closed

    def push(self, out: TokenOutput) -> None:
        if self._ended or self.closed:
            return
        if len(self._items) >= self.limit:
            self.end(StreamCut(f"stream cut: the client read too slowly ({len(self._items)} outputs waiting)"))
            if self.on_cut is not None:
                self.on_cut()
            self._abort()
            return
        self._items.append(out)
        self._wake()

    def end(self, error: BaseException | None = None) -> None:
        """No more outputs; `error` reaches the reader after those queued."""
        if self._ended:
            return
        self._ended, self._error = True, error
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self, timeout_s: float | None = None) -> TokenOutput | None:
        """The next output; None once the stream has ended; the producer's error, if any, then.
        Raises TimeoutError when nothing came within `timeout_s`."""
        while not self._items:
            if self._ended:
                if self._error is not None:
                    error, self._error = self._error, None
                    raise error
                return None
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                if timeout_s is None:
                    await self._waiter
                else:
                    await asyncio.wait_for(self._waiter, timeout_s)
            finally:
                self._waiter = None
        return self._items.popleft()

    def close(self) -> None:
        """The reader leaves (idempotent): outputs still coming are dropped, the producer told."""
        if self.closed:
            return
        self.closed = True
        self._items.clear()
        self._abort()

    async def aclose(self) -> None:
        """`close`, then wait until the producer has stopped (its aborts sent)."""
        self.close()
        if self.upstream is not None:
            await asyncio.gather(self.upstream, return_exceptions=True)

    def _abort(self) -> None:
        on_abort, self.on_abort = self.on_abort, None  # once
        if on_abort is not None:
            on_abort()
