"""A prompt's scores (protocol/messages.py `PromptLogprobs`, from the prefill worker with the
first output) in the API's shapes: echo's entries, which gateway/formats.py writes as OpenAI's
legacy completions logprobs before the generated tokens', and vLLM's `prompt_logprobs` list.
Pure formatting: no I/O, no request state."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.gateway.formats import LogprobEntries
from pdserve.protocol.messages import PromptLogprobs, TokenLogprob


def echo_entries(
    prompt: Sequence[int], scores: PromptLogprobs | None, top: int, token_text: Callable[[int], str]
) -> LogprobEntries:
    """(token text, its logprob and `top` alternatives) per prompt token; the first token's (and
    every token's when `scores` is missing) is None: nothing scores it."""
    entries: LogprobEntries = [(token_text(prompt[0]), None)] if prompt else []
    for i, t in enumerate(prompt[1:]):
        lp = None
        if scores is not None:
            lp = TokenLogprob(t, scores.logprobs[i], scores.top_ids[i][:top], scores.top_logprobs[i][:top])
        entries.append((token_text(t), lp))
    return entries


def vllm_prompt_logprobs(
    prompt: Sequence[int], scores: PromptLogprobs | None, top: int, token_text: Callable[[int], str]
) -> list[dict[str, dict] | None] | None:
    """vLLM's `prompt_logprobs`: None first, then per prompt token {token id: {logprob, rank,
    decoded_token}} holding the token itself and the `top` most likely (ranks 1..top)."""
    if scores is None:
        return None
    out: list[dict[str, dict] | None] = [None]
    for i, t in enumerate(prompt[1:]):
        entry = {str(t): {"logprob": scores.logprobs[i], "rank": scores.ranks[i], "decoded_token": token_text(t)}}
        for rank, (tid, lp) in enumerate(zip(scores.top_ids[i][:top], scores.top_logprobs[i][:top]), start=1):
            entry.setdefault(str(tid), {"logprob": lp, "rank": rank, "decoded_token": token_text(tid)})
        out.append(entry)
    return out
