"""Two ways to run a step, chosen by what each costs here and now: seconds per unit of work (an
emitted token), an EWMA per batch-size bucket (1, 2-3, 4-7, 8-15, 16-31, ...) for each way.

`allow(n)` says whether a step of n sequences should take the bold way A (speculate:
engine/spec/speculator.py; step on borrowed cores: decode_node/thread_lending.py) rather than B
(the plain step): while A's figure is no worse than B's, or while either is unmeasured (A first).
Now and then a step takes the other way, so both figures stay current as load and acceptance
change: after `FIRST_EXPLORE` steps, then twice as many each time the exploration confirms the
choice (up to `MAX_EXPLORE`: a losing speculative step in a full batch costs ~3 plain ones, so
frequent checks would eat what the choice saves), back to `FIRST_EXPLORE` when the choice flips.
An exploring step's figure counts more (`EXPLORE_ALPHA`), so two explorations that disagree with
the past flip it. Why it is needed: per-sequence draft lengths (spec/adaptive.py) cannot see that
drafts accepted half the time still lose in a full batch (an EAGLE head at 42% acceptance: 1.08x
at one sequence, 0.66x at 16); a step on two OpenMP threads stalls at every barrier once another
job takes a core (one-at-a-time TPOT: median 9 ms, mean up to 147 ms; 15 ms steady on one).
"""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.2  # EWMA weight of the newest step
EXPLORE_ALPHA = 0.5  # ... of a step that took the choice the figures advised against
MIN_SAMPLES = 3  # steps of each kind in a bucket before its figures decide
FIRST_EXPLORE = 16  # steps between explorations, at first and after a flip
MAX_EXPLORE = 256


@dataclass
class _Bucket:
    plain_s_per_token: float = 0.0  # way B
    spec_s_per_token: float = 0.0  # way A
    plain_steps: int = 0
    spec_steps: int = 0
    interval: int = FIRST_EXPLORE  # steps between explorations
    until_explore: int = FIRST_EXPLORE
    advised: bool | None = None  # the figures' last advice (True: speculate)

    def pays(self) -> bool:
        if self.spec_steps < MIN_SAMPLES or self.plain_steps < MIN_SAMPLES:
            return self.spec_steps < MIN_SAMPLES  # measure speculation first, then plain steps
        return self.spec_s_per_token <= self.plain_s_per_token


def bucket_of(num_decoding: int) -> int:
    """0 for one decoding sequence, 1 for 2-3, 2 for 4-7, ..."""
    return max(1, num_decoding).bit_length() - 1


class MeasuredChoice:
    def __init__(self) -> None:
        self.buckets: dict[int, _Bucket] = {}

    def allow(self, num_decoding: int) -> bool:
        """Whether a step of `num_decoding` sequences should take way A."""
        b = self.buckets.setdefault(bucket_of(num_decoding), _Bucket())
        pays = b.pays()
        if b.advised is not None and pays != b.advised:  # the choice flipped: check it again soon
            b.interval = b.until_explore = FIRST_EXPLORE
        b.advised = pays
        b.until_explore -= 1
        if b.until_explore > 0:
            return pays
        b.interval = min(2 * b.interval, MAX_EXPLORE)
        b.until_explore = b.interval
        return not pays

    def observe(self, num_decoding: int, speculated: bool, seconds: float, tokens: int) -> None:
        """A step (of decodes only) that took way A (`speculated`) or B: how long it took and how
        many tokens its sequences emitted."""
        if tokens <= 0 or seconds <= 0:
            return
        b = self.buckets.setdefault(bucket_of(num_decoding), _Bucket())
        cost = seconds / tokens
        a = EXPLORE_ALPHA if b.advised is not None and speculated != b.advised else ALPHA
        if speculated:
            b.spec_s_per_token = cost if b.spec_steps == 0 else (1 - a) * b.spec_s_per_token + a * cost
            b.spec_steps += 1
        else:
            b.plain_s_per_token = cost if b.plain_steps == 0 else (1 - a) * b.plain_s_per_token + a * cost
            b.plain_steps += 1
