"""Decode threads that borrow the prefill pool's cores while no prefill is in flight for them.

On one machine shared by both pools (`pdserve serve`), a decode worker pinned to its share of
the cores leaves the prefill share idle whenever nothing is being prefilled: the tail of a burst,
or any lull between arrivals. Every prefill for this worker holds a KV lease on it from the
reservation until its KV has landed, so "no lease active" means no prefill here needs the cores
now; the worker then steps with `idle` threads, and goes back to `busy` at its next step once a
reservation arrives (an OpenMP step split over a core a prefill is also using waits at every
barrier for the slower half, so lending only while the cores are free is what makes it pay).
The same stall comes from outside pdserve: another job on a lent core makes a two-thread step
wait. So lending also has to be measured to pay (engine/measured_choice.py): the worker reports
each decode-only step's seconds and tokens, and lends only while lent steps cost no more per
token than its own (one-at-a-time TPOT with a job beside it: median 9 ms lent but a mean of up to
147 ms, against a steady 15 ms on its own thread).
"""

from __future__ import annotations

import logging

import torch

from pdserve.engine.measured_choice import MeasuredChoice

log = logging.getLogger(__name__)


class ThreadLending:
    def __init__(self, busy: int, idle: int) -> None:
        if busy < 1 or idle < busy:
            raise ValueError(f"idle threads ({idle}) must be >= busy threads ({busy}) >= 1")
        self.busy, self.idle = busy, idle
        self.current = torch.get_num_threads()
        self.switches = 0
        self.choice = MeasuredChoice()  # way A: lend (measured against the worker's own threads)

    @property
    def enabled(self) -> bool:
        return self.idle > self.busy

    def update(self, prefills_in_flight: int, running: int = 1) -> None:
        """Before a step of `running` sequences: `idle` threads when no prefill for this worker is
        in flight and lending is measured to pay at that batch size, else `busy`."""
        want = self.idle if prefills_in_flight == 0 and self.enabled and self.choice.allow(running) else self.busy
        if want != self.current:
            log.debug("decode step threads %d -> %d (%d prefills in flight)", self.current, want, prefills_in_flight)
            torch.set_num_threads(want)
            self.current = want
            self.switches += 1

    def observe(self, decoding: int, seconds: float, tokens: int) -> None:
        """A decode-only step just run (on `current` threads): its time and tokens emitted."""
        if self.enabled:
            self.choice.observe(decoding, self.current == self.idle, seconds, tokens)
