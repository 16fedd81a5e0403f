"""Per-sequence draft length: speculate only while it pays.

A sequence starts at k drafts. Each verification sets its next length to what was accepted + 1
(so a sequence that keeps accepting stays at k, one that accepts little proposes little), and
after `MISSES_TO_PAUSE` verifications in a row with nothing accepted it stops proposing for a
pause that doubles each time (up to `MAX_PAUSE_STEPS`), then tries again with one draft.
"""

from __future__ import annotations

from dataclasses import dataclass

MISSES_TO_PAUSE = 2
FIRST_PAUSE_STEPS = 4
MAX_PAUSE_STEPS = 64


@dataclass
class DraftLength:
    k_max: int
    k: int = 0  # drafts to propose next (0: set to k_max at the first use)
    misses: int = 0  # verifications in a row that accepted nothing
    pause_steps: int = 0  # steps left without proposing
    next_pause: int = FIRST_PAUSE_STEPS

    def __post_init__(self) -> None:
        if self.k == 0:
            self.k = self.k_max

    def wanted(self) -> int:
        """Drafts to propose this step (0 while paused; a paused step counts down)."""
        if self.pause_steps > 0:
            self.pause_steps -= 1
            return 0
        return self.k

    def observe(self, proposed: int, accepted: int) -> None:
        if accepted == 0:
            self.misses += 1
            if self.misses >= MISSES_TO_PAUSE:
                self.pause_steps, self.misses = self.next_pause, 0
                self.next_pause = min(2 * self.next_pause, MAX_PAUSE_STEPS)
                self.k = 1
                return
        else:
            self.misses = 0
            self.next_pause = FIRST_PAUSE_STEPS
        self.k = max(1, min(self.k_max, accepted + 1 if accepted < proposed else self.k_max))
