"""One tenant's limits with a hand-moved clock: token buckets, in-flight counts, refunds, and
OpenAI's x-ratelimit headers."""

from __future__ import annotations

import pytest

from pdserve.gateway.rate_limits import RateLimited, RequestOverLimit, TenantGate, TokenBucket, openai_duration
from pdserve.gateway.tenants import TenantLimits


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_bucket_bursts_its_minute_then_refills_continuously():
    clock = Clock()
    bucket = TokenBucket(60, clock)  # one a second
    bucket.take(60)
    assert bucket.wait_s(1) == pytest.approx(1.0) and bucket.reset_s() == pytest.approx(60.0)
    clock.now += 0.5
    assert bucket.level() == pytest.approx(0.5)
    clock.now += 0.5
    assert bucket.wait_s(1) == 0.0
    clock.now += 3600
    assert bucket.level() == 60  # never over its capacity
    bucket.take(10)
    bucket.give_back(25)
    assert bucket.level() == 60


@pytest.mark.parametrize(
    "seconds,text", [(0.0, "0ms"), (0.0201, "21ms"), (1.0, "1s"), (1.5, "1.5s"), (59.9, "59.9s"), (360, "6m0s")]
)
def test_reset_times_are_written_as_openai_does(seconds, text):
    assert openai_duration(seconds) == text


def test_requests_per_minute_exact_and_headers():
    clock = Clock()
    gate = TenantGate("team", TenantLimits(requests_per_minute=3), clock)
    granted = [gate.admit(10) for _ in range(3)]
    assert [g.headers["x-ratelimit-remaining-requests"] for g in granted] == ["2", "1", "0"]
    assert granted[0].headers["x-ratelimit-limit-requests"] == "3"
    assert "x-ratelimit-limit-tokens" not in granted[0].headers  # no token limit, no token headers
    with pytest.raises(RateLimited) as refused:
        gate.admit(10)
    assert refused.value.kind == "requests"
    assert refused.value.headers["Retry-After"] == "20"  # one request every 20 s
    assert refused.value.headers["x-ratelimit-reset-requests"] == "1m0s"
    for g in granted:
        g.release(10)
    assert gate.in_flight == 0
    clock.now += 20
    gate.admit(10)  # refilled by one


def test_concurrency_is_checked_before_rates_and_nothing_is_charged_on_refusal():
    clock = Clock()
    gate = TenantGate("team", TenantLimits(max_concurrent_requests=2, requests_per_minute=10), clock)
    first, second = gate.admit(1), gate.admit(1)
    for _ in range(5):
        with pytest.raises(RateLimited) as refused:
            gate.admit(1)
        assert refused.value.kind == "concurrency" and refused.value.headers["Retry-After"] == "1"
    assert gate.headers()["x-ratelimit-remaining-requests"] == "8"  # refusals took nothing
    first.release(1)
    first.release(1)  # a second release is a no-op
    assert gate.in_flight == 1
    gate.admit(1)
    second.release(1)


def test_tokens_are_charged_up_front_and_the_unused_rest_returns():
    clock = Clock()
    gate = TenantGate("team", TenantLimits(tokens_per_minute=100), clock)
    a = gate.admit(60)  # e.g. prompt 10 + max_tokens 50
    assert a.headers["x-ratelimit-remaining-tokens"] == "40"
    with pytest.raises(RateLimited) as refused:
        gate.admit(50)
    assert refused.value.kind == "tokens"
    assert refused.value.headers["Retry-After"] == "6"  # 10 tokens short at 100/60 a second
    a.release(15)  # it stopped early: 45 tokens come back
    assert gate.headers()["x-ratelimit-remaining-tokens"] == "85"
    gate.admit(50)
    with pytest.raises(RequestOverLimit, match="over the 100 tokens per minute"):
        gate.admit(101)  # no wait would let it through


def test_an_unlimited_tenant_counts_in_flight_and_sends_no_headers():
    gate = TenantGate("anonymous", TenantLimits(), Clock())
    grants = [gate.admit(10**9) for _ in range(1000)]
    assert gate.in_flight == 1000 and grants[0].headers == {}
    for g in grants:
        g.release(0)
    assert gate.in_flight == 0
