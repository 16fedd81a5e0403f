"""One tenant's limits, enforced at admission: requests and tokens per minute (token buckets),
requests in flight, and the headers OpenAI's API sends about them.

A bucket holds up to its per-minute limit and refills continuously (limit / 60 per second), so
a burst of the whole minute's allowance passes and then one request (or token) per 1/rate s.
`TenantGate.admit` checks every limit and charges them in one synchronous call: under any
number of concurrent requests on the event loop, exactly as many pass as the limits allow. A
request is charged prompt + max_tokens per sequence; at its end the unused part returns
(`Admission.release`). The clock is injected: tests move time by hand.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pdserve.gateway.tenants import TenantLimits

LimitKind = Literal["requests", "tokens", "concurrency"]


class TokenBucket:
    def __init__(self, per_minute: int, clock: Callable[[], float]) -> None:
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0  # per second
        self._clock = clock
        self._level = self.capacity
        self._at = clock()

    def level(self) -> float:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now
        return self._level

    def wait_s(self, amount: float) -> float:
        """Seconds until `amount` is available (0: now; float dust below 1e-9 counts as there)."""
        missing = amount - self.level()
        return 0.0 if missing <= 1e-9 else missing / self.rate

    def reset_s(self) -> float:
        """Seconds until the bucket is full again (OpenAI's x-ratelimit-reset-*)."""
        return (self.capacity - self.level()) / self.rate

    def take(self, amount: float) -> None:
        self._level = self.level() - amount

    def give_back(self, amount: float) -> None:
        self._level = min(self.capacity, self.level() + amount)


def openai_duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: 20ms, 1.5s, 6m0s."""
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    if seconds < 60:
        return f"{math.ceil(seconds * 1000) / 1000:g}s"
    minutes, rest = divmod(math.ceil(seconds), 60)
    return f"{minutes}m{rest}s"


class RateLimited(Exception):
    """Over one of the tenant's limits: 429 with Retry-After and the x-ratelimit headers."""

    def __init__(self, message: str, kind: LimitKind, retry_after_s: float, headers: dict[str, str]) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry_after_s = retry_after_s
        self.headers = {**headers, "Retry-After": str(max(1, math.ceil(retry_after_s)))}


class RequestOverLimit(Exception):
    """A request no wait would let through (more tokens than a minute's allowance): 400."""


@dataclass
class Admission:
    """One admitted request's charge; `release` once at its end (later calls do nothing)."""

    gate: TenantGate
    tokens_charged: int
    headers: dict[str, str]  # the x-ratelimit headers as of admission
    released: bool = field(default=False)

    def release(self, tokens_used: int) -> None:
        if self.released:
            return
        self.released = True
        self.gate._release(self, tokens_used)


class TenantGate:
    """A tenant's limits and live counts (one per key)."""

    def __init__(self, name: str, limits: TenantLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.limits = limits
        self.in_flight = 0
        self.requests = None if limits.requests_per_minute is None else TokenBucket(limits.requests_per_minute, clock)
        self.tokens = None if limits.tokens_per_minute is None else TokenBucket(limits.tokens_per_minute, clock)

    def headers(self) -> dict[str, str]:
        """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens}, for the limits set."""
        out = {}
        for kind, bucket in (("requests", self.requests), ("tokens", self.tokens)):
            if bucket is not None:
                out[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
                out[f"x-ratelimit-remaining-{kind}"] = str(max(0, math.floor(bucket.level())))
                out[f"x-ratelimit-reset-{kind}"] = openai_duration(bucket.reset_s())
        return out

    def admit(self, tokens: int) -> Admission:
        """Charge one request of `tokens` (prompt + max_tokens per sequence) against every limit,
        or raise RateLimited (nothing charged) / RequestOverLimit."""
        lim = self.limits
        if self.tokens is not None and tokens > self.tokens.capacity:
            raise RequestOverLimit(
                f"the request may use {tokens} tokens (prompt + max_tokens per sequence), over the "
                f"{int(self.tokens.capacity)} tokens per minute of key '{self.name}': lower max_tokens"
            )
        if lim.max_concurrent_requests is not None and self.in_flight >= lim.max_concurrent_requests:
            raise RateLimited(
                f"key '{self.name}' has {self.in_flight} requests in flight, its limit "
                f"(max_concurrent_requests {lim.max_concurrent_requests}); retry when one ends",
                "concurrency",
                1.0,
                self.headers(),
            )
        if self.requests is not None and self.requests.wait_s(1) > 0:
            wait = self.requests.wait_s(1)
            raise RateLimited(
                f"rate limit reached for key '{self.name}' on requests per minute: limit "
                f"{int(self.requests.capacity)}; try again in {openai_duration(wait)}",
                "requests",
                wait,
                self.headers(),
            )
        if self.tokens is not None and self.tokens.wait_s(tokens) > 0:
            wait = self.tokens.wait_s(tokens)
            raise RateLimited(
                f"rate limit reached for key '{self.name}' on tokens per minute: limit "
                f"{int(self.tokens.capacity)}, requested {tokens}; try again in {openai_duration(wait)}",
                "tokens",
                wait,
                self.headers(),
            )
        if self.requests is not None:
            self.requests.take(1)
        if self.tokens is not None:
            self.tokens.take(tokens)
        self.in_flight += 1
        return Admission(self, tokens, self.headers())

    def _release(self, admission: Admission, tokens_used: int) -> None:
        self.in_flight -= 1
        if self.tokens is not None and tokens_used < admission.tokens_charged:
            self.tokens.give_back(admission.tokens_charged - tokens_used)
