"""Batched sampling: greedy, temperature, top-k, top-p, min-p, penalties, per-request seeds,
logprobs.

Order per row: penalties -> min_tokens suppression -> grammar mask (constrained rows,
engine/structured/) -> temperature -> top-k -> top-p -> min-p -> draw. Logprobs are reported
from the RAW model distribution (log_softmax of the logits before any processing), as vLLM does
by default.

A seeded row draws from a generator seeded by (seed, number of tokens it has generated), so its
output does not depend on batch composition, on which worker samples it (a prefill worker
draws the first token, a decode worker the rest) or on preemption.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.protocol.messages import TokenLogprob
from pdserve.protocol.sampling import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def _mix_seed(seed: int, step: int) -> int:
    """splitmix64 of (seed, step): independent streams per step, reproducible everywhere."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int], seed: int | None = None) -> None:
        self.eos_token_ids = list(eos_token_ids)
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        mask: Callable[[torch.Tensor], None] | None = None,
    ) -> SamplerOutput:
        """logits [B, V] -> one token per row (the caller's tensor is not modified). `mask`, when
        some rows are constrained, sets their disallowed tokens to -inf in place (a [B, V] copy)."""
        logits = logits.float()
        simple = all(
            p.greedy and not p.uses_penalties and p.logprobs is None and len(out) >= p.min_tokens
            for p, out in zip(params, output_token_ids)
        )
        if simple:  # the decode hot path
            if mask is not None:
                logits = logits.clone()
                mask(logits)
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(params))

        raw = logits
        x = logits.clone()  # [B, V]
        for i, (p, prompt, out) in enumerate(zip(params, prompt_token_ids, output_token_ids)):
            if p.uses_penalties:
                self._apply_penalties(x[i], p, prompt, out)
            if len(out) < p.min_tokens:
                banned = [t for t in (*self.eos_token_ids, *p.stop_token_ids) if 0 <= t < x.shape[1]]
                x[i, banned] = float("-inf")
        if mask is not None:
            mask(x)

        tokens = x.argmax(dim=-1)  # [B] greedy rows keep this
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=x.device)
            probs = self._filtered_probs(x[rows], [params[i] for i in random_rows])  # [R, V]
            for r, i in enumerate(random_rows):
                tokens[i] = self._draw(probs[r], params[i], len(output_token_ids[i]))
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw, params, token_list))

    @staticmethod
    def _apply_penalties(row: torch.Tensor, p: SamplingParams, prompt: Sequence[int], out: Sequence[int]) -> None:
        """row [V] in place. Repetition (HF): over prompt + output; presence/frequency (OpenAI): output;
        then logit_bias (OpenAI) added to the named tokens."""
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(out)), dtype=torch.long, device=row.device)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if out and (p.presence_penalty or p.frequency_penalty):
            counts = torch.bincount(
                torch.tensor(out, dtype=torch.long, device=row.device), minlength=row.shape[0]
            ).float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias if t < row.shape[0]], dtype=torch.long, device=row.device)
            row[ids] += torch.tensor([b for t, b in p.logit_bias if t < row.shape[0]], device=row.device)

    @staticmethod
    def _filtered_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """x [R, V] logits -> probabilities after temperature, top-k, top-p, min-p."""
        dev = x.device
        temps = torch.tensor([p.temperature for p in params], device=dev).unsqueeze(1)  # [R, 1]
        x = x / temps
        vocab = x.shape[1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev).clamp(max=vocab)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        min_p = torch.tensor([p.min_p for p in params], device=dev)
        if bool((top_k < vocab).any()) or bool((top_p < 1).any()):
            sorted_x, order = x.sort(dim=-1, descending=True)  # [R, V]
            ranks = torch.arange(vocab, device=dev).unsqueeze(0)  # [1, V]
            drop = ranks >= top_k.unsqueeze(1)  # top-k
            sorted_probs = sorted_x.masked_fill(drop, float("-inf")).softmax(dim=-1)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
            drop |= before >= top_p.unsqueeze(1)  # top-p (the top token always survives)
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            x = torch.full_like(x, float("-inf")).scatter(1, order, sorted_x)
        probs = x.softmax(dim=-1)  # [R, V]
        if bool((min_p > 0).any()):
            floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < floor, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def _draw(self, probs: torch.Tensor, p: SamplingParams, step: int) -> int:
        """A categorical draw by the inverse CDF: the first token whose cumulative probability
        (float64) passes u * total, u ~ U[0, 1) one number from a CPU generator whatever the device,
        so a seed draws the same on CPU and GPU workers. A token of no probability is never drawn.
        (One number, not a race of V exponentials: over a 128k vocabulary that took 4-8 ms a
        token on one core, a quarter of a 1B model's decode step.)"""
        if p.seed is not None:
            gen = torch.Generator().manual_seed(_mix_seed(p.seed, step))
        else:
            gen = self._generator
        cdf = probs.double().cumsum(0)  # [V]
        u = torch.rand((), dtype=torch.float64, generator=gen).to(cdf.device) * cdf[-1]
        i = int(torch.searchsorted(cdf, u.reshape(1), right=True))
        return i if i < probs.shape[0] else int(probs.nonzero().max())  # (u rounded up to the total)

    @staticmethod
    def _logprobs(raw: torch.Tensor, params: Sequence[SamplingParams], tokens: list[int]) -> list[TokenLogprob | None]:
        if all(p.logprobs is None for p in params):
            return [None] * len(params)
        out: list[TokenLogprob | None] = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
                continue
            lp = raw[i].log_softmax(dim=-1)  # [V]
            top = lp.topk(p.logprobs) if p.logprobs else None
            out.append(
                TokenLogprob(
                    tokens[i],
                    float(lp[tokens[i]]),
                    top.indices.tolist() if top is not None else [],
                    top.values.tolist() if top is not None else [],
                )
            )
        return out
