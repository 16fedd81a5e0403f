"""A request attempt's outputs in token order, per choice.

P's first token and D's tokens travel on different sockets, so D's second token can arrive
before P's first. Each output says where its tokens start (`index`, counted per choice); an
output that is next goes through at once (the common case: no dict touched), one that is early
waits in `held` until the gap before it is filled:

    next_index[c] = 3      arrive(index 4) -> held {4}      arrive(index 3) -> emit 3, then 4
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from pdserve.protocol.messages import TokenOutput

log = logging.getLogger(__name__)


class TokenOrder:
    __slots__ = ("next_index", "held", "unfinished")

    def __init__(self, choices: int) -> None:
        self.next_index = [0] * choices  # per choice: the index of the next output to emit
        self.held: list[dict[int, TokenOutput]] = [{} for _ in range(choices)]  # early arrivals
        self.unfinished = choices  # choices without a finish yet

    def arrive(self, out: TokenOutput, emit: Callable[[TokenOutput], None]) -> bool:
        """Emit `out` and whatever it unblocks, in order; True once every choice has finished."""
        i = out.seq_index
        if not 0 <= i < len(self.next_index):
            log.warning("request %s: output for choice %d of %d dropped", out.request_id, i, len(self.next_index))
            return False
        if out.index != self.next_index[i]:
            self.held[i][out.index] = out
            return False
        held = self.held[i]
        while True:
            self.next_index[i] += max(1, len(out.token_ids))
            if out.finish_reason is not None:
                self.unfinished -= 1
            emit(out)
            if not self.unfinished:
                return True
            if not held:
                return False
            nxt = held.pop(self.next_index[i], None)
            if nxt is None:
                return False
            out = nxt
