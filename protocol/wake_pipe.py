"""A pipe that wakes a worker's poll loop from another thread: `wake` writes a byte (never blocks:
a full pipe already wakes the loop), the loop polls `fd` and calls `clear` before it collects."""

from __future__ import annotations

import os


class WakePipe:
    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    @property
    def fd(self) -> int:
        """Readable once `wake` was called since the last `clear`."""
        return self._r

    def wake(self) -> None:
        try:
            os.write(self._w, b"x")
        except (BlockingIOError, OSError):
            pass  # full of wake-ups already (or closed)

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self._r)
        os.close(self._w)
