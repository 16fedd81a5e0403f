"""Prompt logprobs (SamplingParams.prompt_logprobs: echo, vLLM's prompt_logprobs): every prompt
token's log-probability given the tokens before it, its rank and the top-K alternatives.

A prefill chunk of a sequence that asks adds a logits row for each of its positions but the
prompt's last (whose row is the one sampled): position p scores prompt token p + 1.

    prompt     t0   t1   t2   t3   t4          (L = 5)
    position    0    1    2    3    4
    scores     t1   t2   t3   t4    -          (row 4: the first output token's)

The rows come out of the step's one LM-head pass (`ForwardBatch.head_rows`); `score_rows`
reduces them to plain numbers on the thread that ran the head (fp32 log_softmax, in slices so a
long prompt never holds a second [P, V] tensor), and `PromptScores` gathers a sequence's chunks
by position until the first output token carries them out (`PromptLogprobs`). Prefix-cache
reuse would skip positions, so such a prompt is computed whole (engine/scheduler.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.protocol.messages import PromptLogprobs

SLICE_ROWS = 256  # rows log_softmax'd at a time: [SLICE_ROWS, V] fp32 at most beside the logits


@dataclass(frozen=True)
class ChunkScores:
    """One prefill chunk's scores: prompt tokens first + 1 .. first + n."""

    first: int  # the first position scored (it scores prompt token first + 1)
    logprobs: list[float]  # [n]
    ranks: list[int]  # [n]
    top_ids: list[list[int]]  # [n][K]
    top_logprobs: list[list[float]]  # [n][K]


def score_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[list, list, list, list]:
    """logits [P, V] (any float dtype), targets [P] (each row's next prompt token) -> the
    targets' logprobs [P], ranks [P] (1 + tokens strictly more likely), and the top-k ids and
    logprobs [P][k], as lists."""
    lps: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_lps: list[list[float]] = []
    for start in range(0, logits.shape[0], SLICE_ROWS):
        lp = logits[start : start + SLICE_ROWS].float().log_softmax(dim=-1)  # [s, V]
        tgt = targets[start : start + SLICE_ROWS].unsqueeze(1)  # [s, 1]
        picked = lp.gather(1, tgt)  # [s, 1]
        lps += picked.squeeze(1).tolist()
        ranks += ((lp > picked).sum(dim=1) + 1).tolist()
        if k:
            top = lp.topk(k, dim=-1)  # [s, k]
            top_ids += top.indices.tolist()
            top_lps += top.values.tolist()
        else:
            top_ids += [[] for _ in range(lp.shape[0])]
            top_lps += [[] for _ in range(lp.shape[0])]
    return lps, ranks, top_ids, top_lps


class PromptScores:
    """A sequence's prompt scores as its chunks compute them (by position: a chunk computed again
    after a preemption overwrites its own)."""

    def __init__(self, num_prompt_tokens: int, k: int) -> None:
        n = num_prompt_tokens - 1
        self.k = k
        self.logprobs: list[float] = [0.0] * n
        self.ranks: list[int] = [0] * n
        self.top_ids: list[list[int]] = [[] for _ in range(n)]
        self.top_logprobs: list[list[float]] = [[] for _ in range(n)]
        self._done = [False] * n
        self._left = n

    def add(self, chunk: ChunkScores) -> None:
        for j in range(len(chunk.logprobs)):
            p = chunk.first + j
            self.logprobs[p] = chunk.logprobs[j]
            self.ranks[p] = chunk.ranks[j]
            self.top_ids[p] = chunk.top_ids[j][: self.k]
            self.top_logprobs[p] = chunk.top_logprobs[j][: self.k]
            if not self._done[p]:
                self._done[p] = True
                self._left -= 1

    @property
    def complete(self) -> bool:
        return self._left == 0

    def message(self) -> PromptLogprobs:
        assert self.complete, "prompt scores requested before every position was computed"
        return PromptLogprobs(self.logprobs, self.ranks, self.top_ids, self.top_logprobs)
