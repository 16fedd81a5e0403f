"""Prompt-lookup proposals: find the sequence's last n tokens earlier in it (prompt and output so
far, n from `max_n` down to `min_n`) and propose the tokens that followed the latest such match.

    tokens:  a b c d e b c d ? ?         tail "b c d" (n = 3) matched at 1..3
                   ^^^^^ ~~~             proposal: "e b" (k = 2), what followed the match
    tokens:  x y x y                     tail "x y" matched at 0..1: "x y x" (k = 3)
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens for what follows `tokens`; [] when no tail n-gram recurs."""
    size = len(tokens)
    if k < 1 or size < min_n + 1:
        return []
    last = tokens[-1]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        tail = list(tokens[size - n :])
        # latest start i < size - n with tokens[i : i + n] == tail (its last token at i + n - 1)
        for end in range(size - 2, n - 2, -1):
            if tokens[end] == last and list(tokens[end - n + 1 : end + 1]) == tail:
                return _copy_from(tokens, end + 1, k)
    return []


def _copy_from(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """`k` tokens copied from `start` on; past the end the copy reads its own output (an
    overlapping copy, as LZ77 does), so a loop of period p proposes k tokens, not p."""
    size, out = len(tokens), list[int]()
    for i in range(start, start + k):
        out.append(tokens[i] if i < size else out[i - size])
    return out
