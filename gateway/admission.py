"""The gateway's admission queue: a request waits here, by priority and then first come first
served, until a worker of its pool can take it, instead of being refused because the pool is
full right now.

    arrive --queue empty and a start succeeds--------------------------------> started
       |
       +--bounds hold--> wait (priority, FIFO) --its turn--> try_start --ok--> started
       |                     ^                                  |
       |                     +----------no room (blocked)-------+   blocked until `notify()` (a
       |                                           request ended, a heartbeat, a worker joined)
       +--queue over max_requests / max_tokens --> QueueFull (429)
                         wait over max_wait_s -------------> QueueTimeout (503)

Refusals happen before the request's first token, so the client gets a status code with
`Retry-After`, never a stream that breaks midway.

Turns go out by priority (lower first: vLLM's `priority`, from the request or its API key,
gateway/tenants.py), in arrival order within one priority, up to `free_slots()` at once (the
gateway's estimate of free worker seats: several requests start together when a decode step
finished several sequences) and at least one, so a wrong estimate costs a retry, not a stall.
When a turn finds no room, the waiter goes back to its place in the queue and the queue stops
handing out turns until capacity may have changed. Priority only orders who starts next: a running request is never
preempted for a more urgent one. A request resumed on a new worker goes before every other.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Annotated, Generic, TypeVar

from pdserve.flag import Flag, positive_float
from pdserve.gateway.backend import BackendUnavailable
from pdserve.gateway.queue_stats import QueueStats

T = TypeVar("T")

# The priority of the request this task serves (lower = more urgent): set by the HTTP layer
# (gateway/generation.py) for its backend stream, read where they call `admit`.
request_priority: ContextVar[int] = ContextVar("request_priority", default=0)


class QueueFull(BackendUnavailable):
    """The queue holds its maximum already: refused at once (HTTP 429)."""

    status = 429
    code = "queue_full"


class QueueTimeout(BackendUnavailable):
    """Waited `max_wait_s` without a worker taking it (HTTP 503)."""

    status = 503
    code = "queue_timeout"


@dataclass(frozen=True)
class QueueLimits:
    max_requests: Annotated[
        int,
        Flag(
            "requests waiting per pool for a worker to take them; more get 429 + Retry-After",
            name="--max-queued-requests",
        ),
    ] = 1024
    max_tokens: Annotated[
        int, Flag("prompt tokens waiting per pool; more get 429 + Retry-After", name="--max-queued-tokens")
    ] = 2**21
    max_wait_s: Annotated[
        float,
        Flag(
            "seconds a request may wait for a worker to take it before a 503 + Retry-After (one moving off a lost "
            "worker after its first tokens: an error event; nothing waits in a queue forever)",
            name="--max-queue-wait",
            parse=positive_float,
        ),
    ] = 300.0

    def __post_init__(self) -> None:
        if self.max_requests < 1 or self.max_tokens < 1:
            raise ValueError("queue bounds must be >= 1")
        if self.max_wait_s <= 0:
            raise ValueError("max_wait_s must be > 0")


class _Waiter:
    __slots__ = ("rank", "tokens", "turn")

    def __init__(self, rank: tuple[int, int, int], tokens: int) -> None:
        self.rank = rank  # (0 resumed / 1 new, priority, arrival): the queue's sort key
        self.tokens = tokens
        self.turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class AdmissionQueue(Generic[T]):
    def __init__(
        self,
        pool: str,
        limits: QueueLimits,
        free_slots: Callable[[], int],
        on_wait: Callable[[str, float], None] | None = None,
        on_timeout: Callable[[str], None] | None = None,
    ) -> None:
        self.pool = pool
        self.limits = limits
        self._free_slots = free_slots
        self._on_wait = on_wait  # (pool, seconds waited) of every request that started
        self._on_timeout = on_timeout  # ("queue_timeout") of every request that waited past max_wait_s
        self._waiting: list[_Waiter] = []  # by rank: resumed, then priority, then arrival
        self._tokens = 0
        self._turns_out = 0  # waiters trying to start now
        self._blocked = False  # the last turn found no room: no more turns until notify()
        self._order = itertools.count(1)

    def stats(self) -> QueueStats:
        return QueueStats(len(self._waiting) + self._turns_out, self._tokens)

    def notify(self) -> None:
        """Capacity may have changed: hand out turns again."""
        self._blocked = False
        self._dispatch()

    async def admit(
        self,
        num_tokens: int,
        try_start: Callable[[], Awaitable[T | None]],
        *,
        resumed: bool = False,
        priority: int = 0,
    ) -> T:
        """Run `try_start` (None = no room now) in this request's turn until it starts; raises
        QueueFull / QueueTimeout. Errors from `try_start` end the wait and propagate.
        `priority`: lower waits less (ahead of every waiter with a higher value).
        `resumed`: a request that already streamed tokens (moving off a dead worker) goes first
        and is never refused for a full queue (the client was promised the rest), but it too
        times out after `max_wait_s` (its stream then ends with an error event)."""
        t0 = time.monotonic()
        if not self._waiting and not self._turns_out:  # nobody ahead: try at once
            started = await try_start()
            if started is not None:
                self._observe(t0)
                return started
            self._blocked = True
        if not resumed:
            self._check_room(num_tokens)
        waiter = _Waiter((0, 0, next(self._order)) if resumed else (1, priority, next(self._order)), num_tokens)
        max_wait_s = self.limits.max_wait_s  # (a resumed request too: nothing waits forever)
        self._waiting.append(waiter)
        self._waiting.sort(key=lambda w: w.rank)
        self._tokens += num_tokens
        try:
            while True:
                self._dispatch()
                remaining = t0 + max_wait_s - time.monotonic()
                try:
                    await asyncio.wait_for(asyncio.shield(waiter.turn), max(0.0, remaining))
                except asyncio.TimeoutError:
                    if not waiter.turn.done():
                        if self._on_timeout is not None:
                            self._on_timeout("queue_timeout")
                        raise QueueTimeout(
                            f"the {self.pool} pool did not take the request within "
                            f"{self.limits.max_wait_s:g} s ({len(self._waiting)} requests "
                            f"waiting)",
                            retry_after_s=self._retry_after(),
                        ) from None
                try:
                    started = await try_start()
                finally:
                    self._turns_out -= 1
                    waiter.turn = asyncio.get_running_loop().create_future()
                if started is not None:
                    self._observe(t0)
                    return started
                # no room: back to its place in the queue, wait for capacity to change
                self._waiting.append(waiter)
                self._waiting.sort(key=lambda w: w.rank)
                self._blocked = True
        finally:
            if waiter in self._waiting:
                self._waiting.remove(waiter)
            elif waiter.turn.done():  # handed a turn it never used (cancelled meanwhile)
                self._turns_out -= 1
            self._tokens -= num_tokens
            self._dispatch()

    def _check_room(self, num_tokens: int) -> None:
        lim = self.limits
        if len(self._waiting) + 1 > lim.max_requests or self._tokens + num_tokens > lim.max_tokens:
            raise QueueFull(
                f"the {self.pool} queue is full ({len(self._waiting)} requests, {self._tokens} "
                f"prompt tokens waiting; limits {lim.max_requests} and {lim.max_tokens})",
                retry_after_s=self._retry_after(),
            )

    def _dispatch(self) -> None:
        """Hand turns to the first waiters (most urgent, then oldest), as many as there may be free
        seats (at least one)."""
        if self._blocked or not self._waiting:  # (a request ending with nobody queued: nothing to do)
            return
        budget = max(1, self._free_slots()) - self._turns_out
        while budget > 0 and self._waiting:
            waiter = self._waiting.pop(0)
            self._turns_out += 1
            budget -= 1
            if not waiter.turn.done():
                waiter.turn.set_result(None)

    def _observe(self, t0: float) -> None:
        if self._on_wait is not None:
            self._on_wait(self.pool, time.monotonic() - t0)

    def _retry_after(self) -> float:
        return float(min(30, max(1, len(self._waiting) // 16)))
