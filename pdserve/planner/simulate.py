"""Event-by-event simulation of a pdserve cluster on a request stream, with step costs from a
fitted cost model (costs.py): what the gateway, the pools and the transfers would do, and each
request's TTFT and TPOT.

    gateway    FIFO admission: the head waits until a decode worker has a seat (`max_num_seqs`)
               and KV blocks for its prompt and output; then the decode worker with the most free
               seats, and the prefill worker with the fewest prompt tokens queued
    prefill    FCFS steps of up to `budget` tokens (prompts chunked); a prompt's first token
               comes at the end of the step holding its last chunk; its KV's tail (the last
               layer's share) then crosses to the decode worker
    decode     continuous batching: every running sequence gains a token each step; sequences
               that arrived during a step join the next
    colocated  one worker: each step decodes every running sequence and prefills up to `budget`
               prompt tokens (FCFS), as pdserve's colocated worker does

Workers on one machine (`machine_cores`) share its cores: a step that starts while k workers
are busy runs with cores / k of them (the profiled costs for that many threads, slowed in
proportion below one thread). Workers on their own machines (`cores_per_worker`) do not share.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from pdserve.planner.costs import CostModel


@dataclass(frozen=True)
class Layout:
    prefill: int  # workers (0 with colocated)
    decode: int
    colocated: int = 0
    machine_cores: float | None = None  # all workers share these cores (one machine)
    cores_per_worker: float = 1.0  # else each worker has this many to itself

    @property
    def name(self) -> str:
        return f"colocated x{self.colocated}" if self.colocated else f"{self.prefill}P{self.decode}D"

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.colocated


@dataclass(frozen=True)
class Limits:
    budget: int = 512  # prompt tokens per prefill (or colocated) step
    max_num_seqs: int = 64  # per decode (or colocated) worker
    num_blocks: int = 4096  # KV blocks per decode (or colocated) worker


@dataclass
class Req:
    arrival: float
    prompt: int
    output: int
    computed: int = 0  # prompt tokens prefilled so far
    tokens: int = 0  # output tokens so far
    first_token: float = math.nan
    finish: float = math.nan
    decode: _Worker | None = None

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (self.finish - self.first_token) / (self.output - 1) if self.output > 1 else 0.0


@dataclass(eq=False)
class _Worker:
    role: str
    index: int
    queue: deque = field(default_factory=deque)  # prefill: requests with prompt left
    running: list = field(default_factory=list)  # decode: sequences in the batch
    joining: list = field(default_factory=list)  # decode: arrived during the current step
    busy_until: float = -1.0
    seats: int = 0  # decode: seats taken (running, joining, and reserved while prefilling)
    blocks: int = 0  # decode: KV blocks reserved
    queued_tokens: int = 0  # prefill: prompt tokens left in its queue


class Simulation:
    def __init__(self, costs: CostModel, layout: Layout, limits: Limits = Limits()) -> None:
        self.costs, self.layout, self.limits = costs, layout, limits
        self.prefills = [_Worker("prefill", i) for i in range(layout.prefill)]
        self.decodes = [_Worker("decode", i) for i in range(layout.decode)]
        self.colocated = [_Worker("colocated", i) for i in range(layout.colocated)]
        self.workers = self.prefills + self.decodes + self.colocated
        self._events: list = []
        self._seq = 0
        self.waiting: deque[Req] = deque()  # at the gateway
        self.now = 0.0

    # --- time and cores -------------------------------------------------------------------
    def _push(self, t: float, kind: str, obj) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, obj))

    def _threads(self) -> float:
        if self.layout.machine_cores is None:
            return self.layout.cores_per_worker
        busy = sum(1 for w in self.workers if w.busy_until > self.now) + 1  # with the one starting
        return self.layout.machine_cores / busy

    def _blocks(self, r: Req) -> int:
        return -(-(r.prompt + r.output) // self.costs.block_size)

    # --- the gateway ----------------------------------------------------------------------
    def _admit(self) -> None:
        lim = self.limits
        while self.waiting:
            r = self.waiting[0]
            pool = self.decodes or self.colocated
            free = [w for w in pool if w.seats < lim.max_num_seqs and w.blocks + self._blocks(r) <= lim.num_blocks]
            if not free:
                return
            self.waiting.popleft()
            d = max(free, key=lambda w: (lim.max_num_seqs - w.seats, -w.index))
            d.seats += 1
            d.blocks += self._blocks(r)
            r.decode = d
            if self.colocated:
                d.queue.append(r)
                self._start(d)
            else:
                p = min(self.prefills, key=lambda w: (w.queued_tokens, w.index))
                p.queue.append(r)
                p.queued_tokens += r.prompt
                self._start(p)

    # --- steps ----------------------------------------------------------------------------
    def _chunks(self, w: _Worker) -> list[tuple[Req, int]]:
        """FCFS chunks up to the budget from the head of `w`'s prompt queue."""
        out, left = [], self.limits.budget
        for r in w.queue:
            if left <= 0:
                break
            n = min(r.prompt - r.computed, left)
            out.append((r, n))
            left -= n
        return out

    def _start(self, w: _Worker) -> None:
        if w.busy_until > self.now:
            return
        if w.role == "decode":
            w.running += w.joining
            w.joining = []
        chunks = self._chunks(w) if w.role != "decode" else []
        decodes = w.running if w.role != "prefill" else []
        if not chunks and not decodes:
            return
        costs, slow = self.costs.costs(self._threads())
        tokens = sum(n for _, n in chunks)
        pairs = sum(n * (r.computed + n / 2) for r, n in chunks)
        context = sum(r.prompt + r.tokens for r in decodes)
        dt = costs.mixed_s(len(decodes), context, tokens, pairs) * slow
        w.busy_until = self.now + dt
        self._push(w.busy_until, "step", (w, chunks, list(decodes)))

    def _step_done(self, w: _Worker, chunks: list[tuple[Req, int]], decodes: list[Req]) -> None:
        now = self.now
        for r in decodes:
            r.tokens += 1
            if r.tokens >= r.output:
                r.finish = now
                w.running.remove(r)
                w.seats -= 1
                w.blocks -= self._blocks(r)
        for r, n in chunks:
            r.computed += n
            w.queued_tokens -= n if w.role == "prefill" else 0
            if r.computed == r.prompt:  # its first token
                w.queue.remove(r)
                r.first_token, r.tokens = now, 1
                if r.tokens >= r.output:
                    r.finish = now
                    assert r.decode is not None
                    r.decode.seats -= 1
                    r.decode.blocks -= self._blocks(r)
                elif w.role == "colocated":
                    w.running.append(r)
                else:
                    self._push(now + self.costs.transfer_tail_s(r.prompt), "kv", r)
        self._admit()  # (starts the workers it hands requests to)
        self._start(w)

    # --- a run ----------------------------------------------------------------------------
    def run(self, requests: list[tuple[float, int, int]]) -> list[Req]:
        """requests: (arrival s, prompt tokens, output tokens) -> each request's outcome."""
        reqs = [Req(a, max(1, p), max(1, o)) for a, p, o in requests]
        for r in reqs:
            self._push(r.arrival, "arrival", r)
        while self._events:
            t, _, kind, obj = heapq.heappop(self._events)
            self.now = t
            if kind == "arrival":
                self.waiting.append(obj)
                self._admit()
            elif kind == "step":
                w, chunks, decodes = obj
                w.busy_until = -1.0
                self._step_done(w, chunks, decodes)
            else:  # "kv": the prompt's KV is on its decode worker: it joins the next step
                d = obj.decode
                d.joining.append(obj)
                self._start(d)
        return reqs


def attainment(reqs: list[Req], ttft_s: float, tpot_s: float) -> float:
    ok = sum(1 for r in reqs if r.ttft <= ttft_s and r.tpot <= tpot_s)
    return ok / len(reqs) if reqs else 0.0


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return math.nan
    k = min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))
    return s[k]
