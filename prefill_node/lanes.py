"""Prefill lanes: threads of one prefill worker that run launched steps a layer at a time.

A prefill worker sized to its share of the cores leaves the decode pool's cores idle between
decode steps. Lanes harvest that time without taking a core from a decode step (they still share
caches and memory bandwidth with it):

- `lanes` normal lanes run at the worker's own priority (its cores);
- `idle_lanes` run under the kernel's SCHED_IDLE policy: they get a core only while nothing
  else wants it, and a waking decode worker preempts them at once (CFS wakeup preemption).

Each lane takes one layer of one step, the oldest runnable first, so a step can move between
lanes at every layer boundary; an idle lane takes a layer only while every normal lane is busy,
so when a normal lane frees up the step comes back to it after at most one layer. Torch runs
each lane's ops on the lane's own thread (ops release the GIL), so lanes are parallel across
sequences without an OpenMP team spanning a core some other process is using: nothing waits at
a barrier for a preempted thread.

Two steps in flight may hold chunks of the same sequence (the second launched after the first:
`LLMEngine.launch` counts a chunk as computed when it launches). The later step runs layer l only
once the earlier one has finished layer l, i.e. after it stored (and shipped) that layer's KV of
the earlier chunk, which the later chunk's attention reads. So a long prompt's chunks go
through the layers as a pipeline, one lane a layer behind the other, and a decode worker
receives every layer's frames for a block in chunk order.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve.protocol.wake_pipe import WakePipe

if TYPE_CHECKING:
    import torch

    from pdserve.engine.engine_core import ForwardPass, SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(eq=False)  # compared by identity
class LaneJob:
    """A launched step on its way through the layers (then the LM head)."""

    fp: ForwardPass
    seq_ids: frozenset[int]  # id() of the sequences it holds chunks of
    after: list[LaneJob]  # earlier jobs in flight sharing a sequence
    logits: torch.Tensor | None = None
    error: BaseException | None = None
    held: bool = False
    done: bool = False


def make_idle_priority() -> str:
    """Put the calling thread under SCHED_IDLE (else the lowest nice); returns which it got."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0 = this thread (Linux)
        return "SCHED_IDLE"
    except (AttributeError, OSError) as e:
        log.warning("SCHED_IDLE not available (%s): idle prefill lanes run at nice 19", e)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice 19"


class LayerRunner(Protocol):
    """What the lanes run a launched step with: the worker's engine (EngineCore)."""

    @property
    def num_layers(self) -> int: ...

    def run_layers(self, fp: ForwardPass, count: int | None = None) -> None: ...

    def logits(self, fp: ForwardPass) -> torch.Tensor | None: ...


class PrefillLanes:
    def __init__(self, runner: LayerRunner, lanes: int = 1, idle_lanes: int = 0) -> None:
        if lanes < 1 or idle_lanes < 0:
            raise ValueError(f"need lanes >= 1 and idle_lanes >= 0 (got {lanes}, {idle_lanes})")
        self.runner = runner
        self.num_layers = runner.num_layers
        self._cond = threading.Condition()
        self._jobs: list[LaneJob] = []  # launch order, until collected
        self._free_normal = 0
        self._stop = False
        self.idle_priority: str | None = None  # what the idle lanes got (make_idle_priority)
        self._wake = WakePipe()  # a byte per finished job, for the owner's poll loop
        self._num_idle = idle_lanes
        self._threads = [
            threading.Thread(target=self._run, args=(False,), daemon=True, name=f"prefill-lane{i}")
            for i in range(lanes)
        ]
        self._threads += [
            threading.Thread(target=self._run, args=(True,), daemon=True, name=f"prefill-idle-lane{i}")
            for i in range(idle_lanes)
        ]
        for t in self._threads:
            t.start()

    @property
    def capacity(self) -> int:
        return len(self._threads)

    @property
    def wake_fd(self) -> int:
        """Readable once a job has finished (collect() empties it)."""
        return self._wake.fd

    @property
    def num_idle(self) -> int:
        return self._num_idle

    def in_flight(self) -> int:
        """Jobs submitted and not finished."""
        with self._cond:
            return sum(not j.done for j in self._jobs)

    def busy_sequences(self) -> frozenset[int]:
        """id() of every sequence a job not yet collected holds a chunk of."""
        with self._cond:
            return frozenset().union(*(j.seq_ids for j in self._jobs)) if self._jobs else frozenset()

    def submit(self, sched: SchedulerOutput, fp: ForwardPass) -> LaneJob:
        """Queue a launched step (`LLMEngine.launch`) for the lanes."""
        seq_ids = frozenset(id(c.seq) for c in sched.chunks)
        with self._cond:
            after = [j for j in self._jobs if not j.done and j.seq_ids & seq_ids]
            job = LaneJob(fp, seq_ids, after)
            self._jobs.append(job)
            self._cond.notify_all()
        return job

    def collect(self) -> list[LaneJob]:
        """Finished jobs, oldest first, removed from the board. A job is handed back only after
        every earlier job sharing a sequence with it, so results come in chunk order."""
        with self._cond:
            self._wake.clear()
            out = []
            for j in self._jobs:
                if j.done and all(a in out for a in j.after if a in self._jobs):
                    out.append(j)
            for j in out:
                self._jobs.remove(j)
            return out

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        for t in self._threads:
            t.join(timeout=5)
        self._wake.close()

    # --- lane threads ------------------------------------------------------------------------
    def _runnable(self, job: LaneJob) -> bool:
        if job.held or job.done:
            return False
        if job.fp.next_layer == self.num_layers:
            return True  # the head reads only this job's rows
        return all(a.done or a.fp.next_layer > job.fp.next_layer for a in job.after)

    def _pick(self, idle: bool) -> LaneJob | None:
        if idle and self._free_normal > 0:
            return None  # a lane at full priority is free: the work is its
        return next((j for j in self._jobs if self._runnable(j)), None)

    def _run(self, idle: bool) -> None:
        if idle:
            self.idle_priority = make_idle_priority()
        while True:
            with self._cond:
                if not idle:
                    self._free_normal += 1
                job = self._pick(idle)
                while job is None and not self._stop:
                    self._cond.wait()
                    job = self._pick(idle)
                if not idle:
                    self._free_normal -= 1
                if self._stop:
                    return
                assert job is not None  # the wait above ends with a job or a stop
                job.held = True
                self._cond.notify_all()  # fewer normal lanes free: an idle lane may take what is left
            self._advance(job)
            with self._cond:
                job.held = False
                self._cond.notify_all()
                if job.done:
                    self._wake.wake()

    def _advance(self, job: LaneJob) -> None:
        """One stage of `job`: its next layer, or the LM head after the last one."""
        try:
            if job.fp.next_layer < self.num_layers:
                self.runner.run_layers(job.fp, 1)
                return
            job.logits = self.runner.logits(job.fp)
        except BaseException as e:  # handed to the worker's loop, which owns the failure
            job.error = e
        job.done = True
