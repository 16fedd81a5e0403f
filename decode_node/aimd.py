"""Adaptive admission: the decode worker's limit on running sequences, found by AIMD.

A fixed `--max-num-seqs` is wrong both ways: too low and the decode batch sits under-filled
while requests queue (TTFT grows, throughput is lost); too high and the worker admits more
sequences than its KV pool or its TPOT target can carry, so it preempts (recomputing whole
prompts) or every token comes late. `AimdLimit` moves the limit between flag bounds
(`--min-num-seqs`, `--max-num-seqs`) from what each step shows:

  - additive increase: +`increase` once every `increase_every_steps` steps that met the TPOT
    target without preemption while the limit was what held admission back (as many sequences
    running as allowed). Not every step: a sequence admitted now needs its KV blocks over the
    hundreds of steps it decodes, so a preemption answers an increase late; stepping up once a
    "round" (TCP's once per round trip) keeps the overshoot small;
  - multiplicative decrease: x `decrease` on a preemption or when the smoothed step time
    (EWMA) breaches the target; then no change for `cooldown_steps` steps, so one overload is
    answered once, and the batch drains toward the new limit (nothing is preempted to enforce it).

The decode worker applies the limit to its scheduler and its reservations, and reports it in its
heartbeats (`WorkerInfo.max_num_seqs`): the gateway's admission queue counts free seats by it, so
the gateway's limit on requests per worker follows.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AimdSettings:
    min_seqs: int
    max_seqs: int
    target_step_s: float  # the TPOT target a decode step must meet
    increase: int = 1
    increase_every_steps: int = 16
    decrease: float = 0.5
    cooldown_steps: int = 8
    ewma_alpha: float = 0.3  # weight of the newest step time in the smoothed one

    def __post_init__(self) -> None:
        if not 1 <= self.min_seqs <= self.max_seqs:
            raise ValueError(f"need 1 <= min_seqs <= max_seqs, got {self.min_seqs}, {self.max_seqs}")
        if not self.target_step_s > 0 or self.increase < 1 or not 0 < self.decrease < 1:
            raise ValueError("need target_step_s > 0, increase >= 1 and 0 < decrease < 1")
        if self.increase_every_steps < 1:
            raise ValueError("need increase_every_steps >= 1")


class AimdLimit:
    def __init__(self, settings: AimdSettings, initial: int | None = None) -> None:
        self.s = settings
        self.limit = min(settings.max_seqs, max(settings.min_seqs, initial or settings.min_seqs))
        self.smoothed_step_s: float | None = None
        self._since_decrease = settings.cooldown_steps
        self._good_steps = 0  # steps that could have increased it since it last moved
        self.increases = 0
        self.decreases = 0

    def observe(self, step_s: float, running: int, preempted: int) -> int:
        """One decode step: its time, the sequences it ran, the sequences it preempted.
        Returns the limit for the next step."""
        a = self.s.ewma_alpha
        self.smoothed_step_s = step_s if self.smoothed_step_s is None else a * step_s + (1 - a) * self.smoothed_step_s
        self._since_decrease += 1
        cooled = self._since_decrease > self.s.cooldown_steps
        if preempted or self.smoothed_step_s > self.s.target_step_s:
            self._good_steps = 0
            if cooled and self.limit > self.s.min_seqs:
                self.limit = max(self.s.min_seqs, int(self.limit * self.s.decrease))
                self.decreases += 1
                self._since_decrease = 0
        elif cooled and running >= self.limit and self.limit < self.s.max_seqs:
            self._good_steps += 1
            if self._good_steps >= self.s.increase_every_steps:
                self.limit = min(self.s.max_seqs, self.limit + self.s.increase)
                self.increases += 1
                self._good_steps = 0
        return self.limit
