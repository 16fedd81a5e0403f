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

Workers on their own machines (`cores_per_worker`) run each step in the profiled time for that
many threads. Workers sharing one machine (`machine_cores`, as `pdserve serve` runs them) are
simulated as pdserve arranges them there (cli/topology.py): each step is work in core-seconds
(its one-thread cost; a prefill worker's times `prefill_overhead`) drained at the cores it gets, which
are shared out again at every event: normal-priority demand first (a decode step up to its
threads: its share while a prefill for it is in flight, the borrowed cores otherwise; a
prefill worker's lane; a colocated worker), equally and within each one's threads, then what
is left to prefill's idle-priority lanes. A decode worker paces its steps while prompts for it
queue (decode_node/step_pacing.py), and the gateway's own work takes `gateway_core_s` a request
off the machine.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from pdserve.decode_node.step_pacing import StepPacer
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
    tpot_slo_s: float = 0.060  # what a shared machine's decode pacing is derived from
    prefill_overhead: float = 1.0  # a prefill worker's CPU a prompt token over the profiled step's (calibration)
    gateway_core_s: float = 0.0  # the gateway's CPU a request, on a shared machine (calibration)


@dataclass(eq=False)
class _Fluid:
    """A step on a shared machine: work left (core-s) and the cores it may use, by priority."""

    chunks: list
    decodes: list
    remaining: float  # one-thread seconds of work
    cap_normal: float
    cap_idle: float
    speedup: float = 1.0  # on all the cores it may use, as profiled (a step's overhead does not split)
    cores: float = 0.0  # given now
    rate: float = 0.0  # one-thread seconds done per second

    def speed(self, cores: float) -> float:
        """Work done per second on `cores`: in proportion below one core, then rising to
        `speedup` at its cap."""
        cap = self.cap_normal + self.cap_idle
        if cores <= 1 or cap <= 1:
            return min(cores, 1.0) if cap >= 1 else cores
        return 1 + (min(cores, cap) - 1) * (self.speedup - 1) / (cap - 1)


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
    step: _Fluid | None = None  # shared machine: the step in progress
    last_start: float = -math.inf  # decode: when its last step started (pacing)
    wake_at: float = -math.inf  # decode: a paced start already scheduled


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
        self.shared = layout.machine_cores is not None
        self._version = 0  # of the pending "next completion" event (shared machine)
        self._last_t = 0.0
        if self.shared:
            from pdserve.cli.topology import (
                Topology,
                decode_idle_threads,
                decode_step_interval_ms,
                prefill_idle_lanes,
            )

            topo = Topology(
                cpus=max(1, round(layout.machine_cores or 1)),
                prefill_workers=layout.prefill,
                decode_workers=layout.decode,
                colocated=bool(layout.colocated),
            )
            lanes = prefill_idle_lanes(topo)
            self.prefill_caps = (float(topo.prefill_share), float(lanes * topo.prefill_share))
            self.decode_caps = (float(topo.decode_share), float(decode_idle_threads(topo)))
            self.colocated_cap = float(topo.share if layout.colocated else 0)
            self.pacer = StepPacer(decode_step_interval_ms(topo, lanes, limits.tpot_slo_s * 1e3))

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
        if w.busy_until > self.now or w.step is not None:
            return
        if w.role == "decode":
            if self.shared and self._paced(w):
                return
            w.running += w.joining
            w.joining = []
        chunks = self._chunks(w) if w.role != "decode" else []
        decodes = w.running if w.role != "prefill" else []
        if not chunks and not decodes:
            return
        if self.shared:
            self._start_fluid(w, chunks, list(decodes))
            return
        costs, slow = self.costs.costs(self._threads())
        tokens = sum(n for _, n in chunks)
        pairs = sum(n * (r.computed + n / 2) for r, n in chunks)
        context = sum(r.prompt + r.tokens for r in decodes)
        dt = costs.mixed_s(len(decodes), context, tokens, pairs) * slow
        w.busy_until = self.now + dt
        self._push(w.busy_until, "step", (w, chunks, list(decodes)))

    # --- a shared machine: steps as work drained at the cores they get -----------------------
    def _in_flight(self, d: _Worker) -> int:
        """Prompts for decode worker `d` at a prefill worker or crossing (its active leases)."""
        return d.seats - len(d.running) - len(d.joining)

    def _paced(self, d: _Worker) -> bool:
        """Whether decode pacing holds `d`'s next step back now (a wake-up is then scheduled)."""
        n = self._in_flight(d)
        if not self.pacer.enabled or n <= 1 or not (d.running or d.joining):
            return False
        at = d.last_start + self.pacer.interval_s(n)
        if at <= self.now:
            return False
        if d.wake_at != at:
            d.wake_at = at
            self._push(at, "wake", d)
        return True

    def _start_fluid(self, w: _Worker, chunks: list, decodes: list) -> None:
        one, _ = self.costs.costs(1.0)
        tokens = sum(n for _, n in chunks)
        pairs = sum(n * (r.computed + n / 2) for r, n in chunks)
        context = sum(r.prompt + r.tokens for r in decodes)
        work = one.mixed_s(len(decodes), context, tokens, pairs)
        if tokens and w.role == "prefill":  # (the prefill worker's machinery: lanes, KV streaming)
            work += (self.limits.prefill_overhead - 1) * (one.prefill_s(tokens, pairs) - one.prefill.intercept)
        if w.role == "prefill":
            caps = self.prefill_caps
        elif w.role == "decode":
            caps = (self.decode_caps[0], 0.0) if self._in_flight(w) > 0 else (self.decode_caps[1], 0.0)
            w.last_start = self.now
        else:
            caps = (self.colocated_cap, 0.0)
        many, slow = self.costs.costs(caps[0] + caps[1])
        on_many = many.mixed_s(len(decodes), context, tokens, pairs) * slow
        speedup = max(1.0, one.mixed_s(len(decodes), context, tokens, pairs) / on_many) if on_many > 0 else 1.0
        w.step = _Fluid(chunks, decodes, work, caps[0], caps[1], speedup)
        w.busy_until = math.inf

    def _advance(self, t: float) -> None:
        """Drain every step in progress up to `t` at its current rate."""
        dt = t - self._last_t
        if dt > 0:
            for w in self.workers:
                if w.step is not None:
                    w.step.remaining -= w.step.rate * dt
        self._last_t = t

    def _reallocate(self) -> None:
        """Share the cores out again and schedule the next step end."""
        steps = [w.step for w in self.workers if w.step is not None]
        cores = (self.layout.machine_cores or 1) - self._gateway_load
        for s in steps:
            s.cores = 0.0
        _fill(cores, [(s, s.cap_normal) for s in steps])
        used = sum(s.cores for s in steps)
        _fill(max(0.0, cores - used), [(s, s.cap_idle) for s in steps if s.cap_idle > 0])
        for s in steps:
            s.rate = s.speed(s.cores)
        self._version += 1
        ends = [max(0.0, s.remaining) / s.rate for s in steps if s.rate > 0]
        if ends:
            self._push(self.now + min(ends), "done", self._version)

    def _finish_fluid(self) -> None:
        for w in self.workers:
            s = w.step
            if s is not None and s.remaining <= 1e-9:
                w.step, w.busy_until = None, -1.0
                self._step_done(w, s.chunks, s.decodes)

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
        span = max((r.arrival for r in reqs), default=0.0)
        # the gateway's CPU, spread over the arrivals (it tokenizes, streams and detokenizes)
        self._gateway_load = min(0.5, self.limits.gateway_core_s * len(reqs) / span) if span > 0 else 0.0
        while self._events:
            t, _, kind, obj = heapq.heappop(self._events)
            if self.shared:
                self._advance(t)
            self.now = t
            if kind == "arrival":
                self.waiting.append(obj)
                self._admit()
            elif kind == "step":
                w, chunks, decodes = obj
                w.busy_until = -1.0
                self._step_done(w, chunks, decodes)
            elif kind == "done":
                if obj != self._version:
                    continue  # superseded by a later reallocation
                self._finish_fluid()
            elif kind == "wake":
                obj.wake_at = -math.inf
                self._start(obj)
            else:  # "kv": the prompt's KV is on its decode worker: it joins the next step
                d = obj.decode
                d.joining.append(obj)
                self._start(d)
            if self.shared:
                self._reallocate()
        return reqs


def _fill(cores: float, demands: list[tuple[_Fluid, float]]) -> None:
    """Water-filling: `cores` shared equally among `demands`, none above its cap."""
    left = sorted(demands, key=lambda d: d[1])
    while left and cores > 1e-12:
        each = cores / len(left)
        step, cap = left.pop(0)
        give = min(each, cap)
        step.cores += give
        cores -= give


def attainment(reqs: list[Req], ttft_s: float, tpot_s: float) -> float:
    ok = sum(1 for r in reqs if r.ttft <= ttft_s and r.tpot <= tpot_s)
    return ok / len(reqs) if reqs else 0.0


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return math.nan
    k = min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))
    return s[k]
