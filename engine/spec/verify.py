"""Greedy acceptance of one sequence's drafts against the target's own tokens.

A verification step runs the sequence's last token and its k drafts as one chunk of k + 1 query
rows; row j's logits give the target's token after draft j (row 0: after the last real token).

    query rows:   last   d1    d2    d3          (k = 3)
    target:       t0     t1    t2    t3
    accepted:     d1 == t0, d2 == t1, ... while equal; then t_a (a correction, or the bonus t_k)

The engine emits t_0 .. t_a one at a time through its usual token rules (EOS, stop ids,
max_tokens, the grammar), so a sequence ends exactly where it would without speculation.
Sampling (temperature > 0) draws t_j from row j exactly as without speculation and accepts d_{j+1}
iff t_j == d_{j+1}: with a point-mass draft that is rejection sampling (accept with probability
p(d), else a draw from the residual p without d, renormalised), and a seeded row draws the same
token it would without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence


def num_accepted(drafts: Sequence[int], targets: Sequence[int]) -> int:
    """How many leading drafts the target tokens confirm (targets[j] is the token after draft j)."""
    a = 0
    while a < len(drafts) and a < len(targets) and drafts[a] == targets[a]:
        a += 1
    return a
