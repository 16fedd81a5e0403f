"""A sequence's target hidden states by position, kept for its EAGLE head (engine/spec/eagle.py)
as the pieces the target steps produced: adding a step's rows costs no copy of the older ones
(a sequence may decode many steps without proposing: paused, or a batch too large)."""

from __future__ import annotations

import torch


class HiddenRows:
    """Rows [H] for the positions start .. end - 1, contiguous."""

    def __init__(self, start: int, rows: torch.Tensor) -> None:
        self.pieces: list[tuple[int, torch.Tensor]] = [(start, rows)]  # (first position, [t, H])

    @property
    def start(self) -> int:
        return self.pieces[0][0]

    @property
    def end(self) -> int:
        first, rows = self.pieces[-1]
        return first + rows.shape[0]

    def __len__(self) -> int:
        return self.end - self.start

    def add(self, start: int, rows: torch.Tensor) -> None:
        """Rows of positions start .. (a recomputation replaces what it covers); needs
        self.start < start <= self.end."""
        assert self.start < start <= self.end, (self.start, start, self.end)
        while self.pieces[-1][0] >= start:  # pieces wholly replaced
            self.pieces.pop()
        first, last = self.pieces[-1]
        if first + last.shape[0] > start:
            self.pieces[-1] = (first, last[: start - first])  # [start - first, H]
        self.pieces.append((start, rows))

    def drop_before(self, pos: int) -> None:
        """Forget the pieces that end at or before `pos` (a partly covered one stays whole)."""
        while len(self.pieces) > 1 and self.pieces[0][0] + self.pieces[0][1].shape[0] <= pos:
            self.pieces.pop(0)

    def rows(self, start: int, end: int) -> torch.Tensor:
        """[end - start, H] for positions start .. end - 1 (within what is kept)."""
        assert self.start <= start < end <= self.end, (self.start, start, end, self.end)
        out = []
        for first, rows in self.pieces:
            lo, hi = max(start, first), min(end, first + rows.shape[0])
            if lo < hi:
                out.append(rows[lo - first : hi - first])
        return out[0] if len(out) == 1 else torch.cat(out)
