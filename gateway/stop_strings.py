"""Streaming stop-string matching: text that might begin a stop string is held back until it
either completes one (output ends before it) or can no longer match (it is released)."""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.hit: str | None = None  # the stop string that ended the output, once one has

    def feed(self, text: str) -> tuple[str, bool]:
        """-> (text safe to emit now, whether a stop string was hit)."""
        if not self.stops:
            return text, False
        s = self._held + text
        hits = [(i, stop) for stop in self.stops if (i := s.find(stop)) >= 0]
        if hits:
            self._held = ""
            at, self.hit = min(hits, key=lambda h: h[0])
            return s[:at], True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(s)), hold, -1):
                if s.endswith(stop[:k]):
                    hold = k
                    break
        self._held = s[len(s) - hold :]
        return s[: len(s) - hold], False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out
