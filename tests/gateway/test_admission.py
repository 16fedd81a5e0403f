"""The gateway's admission queue, without processes: FIFO turns, bounds, timeouts, wake-ups."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.gateway.admission import AdmissionQueue, QueueFull, QueueLimits, QueueTimeout


class Pool:
    """A fake worker pool with `seats`; try_start takes one if free."""

    def __init__(self, seats: int) -> None:
        self.seats = seats
        self.started: list[str] = []
        self.attempts = 0

    def free(self) -> int:
        return self.seats

    def starter(self, name: str):
        async def try_start():
            self.attempts += 1
            await asyncio.sleep(0)  # a reservation round trip
            if self.seats <= 0:
                return None
            self.seats -= 1
            self.started.append(name)
            return name

        return try_start


def run(coro):
    return asyncio.run(coro)


def arrive(q: AdmissionQueue, pool: Pool, n: int, tokens: int) -> list[asyncio.Task]:
    """Requests r0 .. r{n-1} of `tokens` prompt tokens each, arriving in order."""
    return [asyncio.create_task(q.admit(tokens, pool.starter(f"r{i}"))) for i in range(n)]


def assert_empty(q: AdmissionQueue) -> None:
    assert q.stats().depth == 0 and q.stats().tokens == 0 and q._turns_out == 0


def test_waits_in_fifo_order_until_seats_free():
    async def go():
        pool = Pool(seats=1)
        waits: list[tuple[str, float]] = []
        q = AdmissionQueue("decode", QueueLimits(), pool.free, lambda pool_, s: waits.append((pool_, s)))
        tasks = arrive(q, pool, 5, 10)
        await asyncio.sleep(0.01)
        assert pool.started == ["r0"] and q.stats().depth == 4 and q.stats().tokens == 40
        for _ in range(4):  # one seat frees at a time (a request ended): the oldest waiter starts
            pool.seats += 1
            q.notify()
            await asyncio.sleep(0.01)
        assert await asyncio.gather(*tasks) == ["r0", "r1", "r2", "r3", "r4"]
        assert pool.started == ["r0", "r1", "r2", "r3", "r4"]
        assert_empty(q)
        assert [p for p, _ in waits] == ["decode"] * 5

    run(go())


def test_blocked_queue_makes_no_attempts_until_notified():
    async def go():
        pool = Pool(seats=0)
        q = AdmissionQueue("decode", QueueLimits(), pool.free)
        tasks = arrive(q, pool, 3, 1)
        await asyncio.sleep(0.05)
        tried = pool.attempts
        assert tried <= 4  # each tried once at arrival (nobody queued yet) or got one turn: no busy loop
        await asyncio.sleep(0.05)
        assert pool.attempts == tried
        pool.seats = 3  # several seats free at once: several turns go out together
        q.notify()
        assert sorted(await asyncio.gather(*tasks)) == ["r0", "r1", "r2"]

    run(go())


def test_bounds_refuse_with_429_and_timeouts_with_503():
    async def go():
        pool = Pool(seats=0)
        q = AdmissionQueue("colocated", QueueLimits(max_requests=2, max_tokens=100, max_wait_s=0.2), pool.free)
        waiting = arrive(q, pool, 2, 40)
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull) as full:  # a third request
            await q.admit(1, pool.starter("r2"))
        assert full.value.status == 429 and full.value.retry_after_s >= 1
        results = await asyncio.gather(*waiting, return_exceptions=True)
        assert all(isinstance(r, QueueTimeout) and r.status == 503 for r in results)
        assert_empty(q)
        q2 = AdmissionQueue("decode", QueueLimits(max_tokens=100), pool.free)
        first = asyncio.create_task(q2.admit(80, pool.starter("big")))
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull, match="prompt tokens"):
            await q2.admit(30, pool.starter("over"))  # 80 + 30 tokens > 100
        first.cancel()

    run(go())


def test_cancelled_waiters_leave_no_trace():
    async def go():
        pool = Pool(seats=0)
        q = AdmissionQueue("decode", QueueLimits(), pool.free)
        tasks = arrive(q, pool, 4, 5)
        await asyncio.sleep(0.01)
        tasks[1].cancel()  # a client went away while it waited
        pool.seats = 1
        q.notify()
        tasks[0].cancel()  # cancelled holding (or about to hold) its turn
        await asyncio.sleep(0.01)
        pool.seats = 5
        q.notify()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        assert sorted(r for r in done if isinstance(r, str)) in (["r2", "r3"], ["r0", "r2", "r3"])
        assert_empty(q)

    run(go())


def test_errors_from_the_start_propagate():
    async def go():
        q = AdmissionQueue("decode", QueueLimits(), lambda: 1)

        async def broken():
            raise RuntimeError("no live decode worker")

        with pytest.raises(RuntimeError):
            await q.admit(1, broken)
        assert q.stats().depth == 0

    run(go())


def test_lower_priority_value_goes_first_and_fifo_within_one():
    async def go():
        pool = Pool(seats=1)
        q = AdmissionQueue("decode", QueueLimits(), pool.free)
        running = asyncio.create_task(q.admit(1, pool.starter("running"), priority=9))
        await asyncio.sleep(0.01)
        arrivals = [("a5", 5), ("b1", 1), ("c5", 5), ("d0", 0), ("e1", 1)]
        tasks = []
        for name, priority in arrivals:  # each arrives after the one before
            tasks.append(asyncio.create_task(q.admit(1, pool.starter(name), priority=priority)))
            await asyncio.sleep(0.01)
        # the pool is full: the urgent arrivals wait; the running request is never preempted
        assert pool.started == ["running"] and q.stats().depth == 5
        for _ in arrivals:
            pool.seats += 1
            q.notify()
            await asyncio.sleep(0.01)
        await asyncio.gather(running, *tasks)
        assert pool.started == ["running", "d0", "b1", "e1", "a5", "c5"]
        assert_empty(q)

    run(go())


def test_a_resumed_request_goes_before_any_priority():
    async def go():
        pool = Pool(seats=0)
        q = AdmissionQueue("decode", QueueLimits(), pool.free)
        urgent = asyncio.create_task(q.admit(1, pool.starter("urgent"), priority=-(2**40)))
        await asyncio.sleep(0.01)
        resumed = asyncio.create_task(q.admit(1, pool.starter("resumed"), resumed=True, priority=7))
        await asyncio.sleep(0.01)
        pool.seats = 1
        q.notify()
        await asyncio.sleep(0.01)
        assert pool.started == ["resumed"]
        pool.seats = 1
        q.notify()
        assert await asyncio.gather(resumed, urgent) == ["resumed", "urgent"]
        assert_empty(q)

    run(go())


def test_a_resumed_request_waits_no_longer_than_the_deadline_either():
    """Nothing waits in a queue forever: a request moving off a lost worker goes first, but with
    no seat for max_wait_s it ends too (its stream then ends with an error), and it is counted."""

    async def go():
        pool = Pool(seats=0)
        timeouts: list[str] = []
        q = AdmissionQueue("disaggregated", QueueLimits(max_wait_s=0.05), pool.free, None, timeouts.append)
        with pytest.raises(QueueTimeout):
            await q.admit(3, pool.starter("resumed"), resumed=True)
        assert timeouts == ["queue_timeout"]
        assert_empty(q)

    run(go())
