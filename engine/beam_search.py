"""Beam search over a group's running beams, step by step, with Hugging Face transformers'
rules (`generate(num_beams=W, do_sample=False)`), so the same weights give the same beams.

Each step, with W running beams that all have `out_len` generated tokens:
  candidates = top K of (log_softmax(beam logits) + beam score), K = max(2, 1 + #stop ids) * W
  a candidate *hits* when its token is an end-of-sequence id or it reaches max_tokens
  running    = the best W candidates that do not hit (K is large enough that W exist,
               unless every candidate hits, which ends the search)
  finished   = the best W of (finished so far, hits ranked in the top W), each scored
               sum logprob / new_len ** length_penalty; none are added once the search cannot
               improve (below) or, with early_stopping=True, once W hypotheses are finished
The search ends when every candidate hits, when W hypotheses are finished and
early_stopping=True, or when the best running beam can no longer beat the worst finished one
(HF's heuristic: its score over the current length, or over max_tokens when
early_stopping="never" and length_penalty > 0). The n best finished hypotheses are returned.

This file is pure bookkeeping: the engine (engine/sequence_group.py) turns a step's decision
into sequences forked, extended and dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.protocol.sampling import SamplingParams

_HIT = -1.0e9  # HF's penalty for a candidate that hit a stop rule (kept out of the running set)


@dataclass(frozen=True)
class Candidate:
    parent: int  # index of the running beam it extends
    token: int
    score: float  # the parent's score + log p(token): the sum of the beam's logprobs


@dataclass(frozen=True)
class Hypothesis:
    output_token_ids: list[int]
    score: float  # length-penalised: sum logprob / len ** length_penalty
    finish_reason: str  # stop | length


@dataclass(frozen=True)
class BeamStep:
    running: list[Candidate]  # the next running beams, best first (empty when the search ended)
    done: bool


@dataclass
class BeamSearch:
    sampling: SamplingParams
    stop_ids: frozenset[int]  # end-of-sequence ids (unless ignore_eos) and stop_token_ids
    max_new_tokens: int  # max_tokens, lowered to what max_model_len leaves after the prompt
    finished: list[Hypothesis] = field(default_factory=list)
    improvable: bool = True

    @classmethod
    def for_request(
        cls, sampling: SamplingParams, eos_token_ids: tuple[int, ...], num_prompt_tokens: int, max_model_len: int
    ) -> BeamSearch:
        stop = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids))
        return cls(sampling, frozenset(stop), min(sampling.max_tokens, max_model_len - num_prompt_tokens))

    @property
    def width(self) -> int:
        return self.sampling.num_seqs

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.stop_ids)) * self.width

    def candidates(self, logits: torch.Tensor, scores: list[float], out_len: int) -> list[Candidate]:
        """logits [W, V] of the running beams (scores: their sums of logprobs) -> the top K."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [W, V]
        if out_len < self.sampling.min_tokens:  # HF's MinNewTokensLength: no end before min_tokens
            banned = [t for t in self.stop_ids if 0 <= t < logprobs.shape[1]]
            logprobs[:, banned] = float("-inf")
        vocab = logprobs.shape[1]
        total = (logprobs + torch.tensor(scores, dtype=torch.float32, device=logprobs.device).unsqueeze(1)).view(
            -1
        )  # [W*V]
        top = torch.topk(total, k=min(self.num_candidates, total.numel()))
        return [
            Candidate(i // vocab, i % vocab, s) for i, s in zip(top.indices.tolist(), top.values.tolist(), strict=True)
        ]

    def step(self, candidates: list[Candidate], parent_outputs: list[list[int]]) -> BeamStep:
        """Advance by one token. `candidates`: the top K, best first; `parent_outputs`: each
        running beam's output tokens so far (all of one length)."""
        width, lp, early = self.width, self.sampling.length_penalty, self.sampling.early_stopping
        new_len = len(parent_outputs[0]) + 1
        at_length = new_len >= self.max_new_tokens
        hits = [at_length or c.token in self.stop_ids for c in candidates]

        order = sorted(range(len(candidates)), key=lambda i: -(candidates[i].score + (_HIT if hits[i] else 0.0)))
        running = [candidates[i] for i in order[:width] if not hits[i]]

        full = len(self.finished) >= width
        if self.improvable and not (full and early is True):
            added = [
                Hypothesis(
                    parent_outputs[c.parent] + [c.token],
                    c.score / new_len**lp,
                    "stop" if c.token in self.stop_ids else "length",
                )
                for c, hit in zip(candidates[:width], hits[:width], strict=True)
                if hit
            ]
            # stable: among equal scores the earlier hypothesis stays ahead (HF's topk merge)
            self.finished = sorted(self.finished + added, key=lambda h: -h.score)[:width]

        best_running = candidates[order[0]].score + (_HIT if hits[order[0]] else 0.0)
        length = self.max_new_tokens if early == "never" and lp > 0 else new_len
        worst = self.finished[-1].score if len(self.finished) >= width else _HIT
        self.improvable = self.improvable and best_running / length**lp > worst
        done = not self.improvable or (len(self.finished) >= width and early is True) or all(hits)
        return BeamStep([] if done else running, done)

    def best(self, n: int) -> list[Hypothesis]:
        """The n returned hypotheses, best first."""
        return self.finished[:n]
