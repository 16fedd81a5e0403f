"""Reasoning output (`--reasoning-parser`, vLLM's names): a thinking model writes its reasoning
between markers before the answer; the gateway sends it apart (chat's `reasoning_content`, the
Responses API's reasoning item, Anthropic's thinking block), and reads tool calls only in the
answer.

  qwen3        `<think>...</think>` (the template may open it in the prompt: the output then
               starts inside it); no `</think>` in the output: all of it is the answer
  deepseek_r1  the same markers, but the template opens the reasoning: no `</think>`: all of it
               is reasoning (cut by max_tokens while thinking)

Streamed, a piece that may begin a marker is held back until it is known, so the deltas add up
to what `split` finds in the whole output.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    always_open: bool  # the template opens the reasoning (deepseek_r1): the output starts inside it

    @property
    def markers(self) -> tuple[str, ...]:
        return (START, END)

    def opened(self, prompt_text: str) -> bool:
        """Whether an output after this prompt starts inside the reasoning (the template ended
        the prompt with the start marker, or this parser's models always do)."""
        return self.always_open or prompt_text.rstrip().endswith(START)

    def prompt_opens(self, prompt: Sequence[int], token_text: Callable[[int], str]) -> bool:
        """`opened` for an output after these prompt tokens (their last few spell the end)."""
        return self.opened("".join(token_text(t) for t in prompt[-4:]))

    def split(self, text: str, opened: bool) -> tuple[str, str]:
        """(reasoning, answer) of a whole output; `opened`: it starts inside the reasoning."""
        if not (opened or text.startswith(START)):
            return "", text  # no reasoning: all of it is the answer
        body = text[len(START) :] if text.startswith(START) else text
        end = body.find(END)
        if end < 0:
            return body, ""  # cut while reasoning
        return body[:end], body[end + len(END) :].lstrip("\n")


REASONING_PARSERS = {
    "qwen3": ReasoningParser("qwen3", always_open=False),
    "deepseek_r1": ReasoningParser("deepseek_r1", always_open=True),
}


def marker_lark(tokenizer: Any, marker: str) -> str:
    """How an output grammar names `marker`: `<think>` (Lark's special-token form) when the
    tokenizer holds it as one added token (llguidance sees every added token as a special one,
    never as its text), else its text as a string literal."""
    added = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}
    return marker if marker in added else json.dumps(marker)


def reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser '{name}' (choices: {', '.join(REASONING_PARSERS)})")
    return REASONING_PARSERS[name]


class ReasoningStream:
    """One choice's output split as it streams: each piece -> (reasoning delta, answer delta),
    adding up to `split` of the whole output."""

    def __init__(self, parser: ReasoningParser, opened: bool) -> None:
        self.parser, self.opened = parser, opened
        self.text = ""
        self.sent = ("", "")  # what was sent of each

    def feed(self, piece: str, final: bool) -> tuple[str, str]:
        self.text += piece
        text = self.text
        if not final:
            if not self.opened and START.startswith(text):
                return "", ""  # it may still open with the marker
            in_reasoning = self.opened or text.startswith(START)
            if in_reasoning and END not in text:  # hold a tail that may begin the end marker
                hold = max((k for k in range(1, len(END)) if text.endswith(END[:k])), default=0)
                text = text[: len(text) - hold]
        reasoning, answer = self.parser.split(text, self.opened)
        if not final and answer and not answer.strip("\n"):
            answer = ""  # (the blank lines after the end marker are not the answer's)
        sent_r, sent_a = self.sent
        if not (reasoning.startswith(sent_r) and answer.startswith(sent_a)):
            return "", ""  # (not reached: each split extends the last)
        self.sent = (reasoning, answer)
        return reasoning[len(sent_r) :], answer[len(sent_a) :]
