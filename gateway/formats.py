"""OpenAI response shapes, completions and chat: what a choice, a stream chunk and logprobs look
like. Pure formatting (no I/O, no request state): gateway/generation.py's `GenerationRun` decides what to say,
these say it in each endpoint's dialect."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve.protocol.messages import TokenLogprob

# (token text, its logprob and top alternatives); None: a token nothing scores (an echoed prompt's first)
LogprobEntries = list[tuple[str, TokenLogprob | None]]


class CompletionFormat:
    """/v1/completions: `text` choices, logprobs as parallel lists with text offsets."""

    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, token_text: Callable[[int], str]) -> None:
        self.token_text = token_text

    def opening_chunks(self, indices: list[int]) -> list[dict]:
        """Stream items sent before any token (none for completions)."""
        return []

    def logprobs(self, entries: LogprobEntries, offset: int = 0) -> dict:
        offsets, pos = [], offset
        for t, _ in entries:
            offsets.append(pos)
            pos += len(t)
        tok = self.token_text
        return {
            "tokens": [t for t, _ in entries],
            "token_logprobs": [lp.logprob if lp is not None else None for _, lp in entries],
            "top_logprobs": [
                {tok(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)} if lp is not None else None
                for _, lp in entries
            ],
            "text_offset": offsets,
        }

    def stream_item(
        self, index: int, delta: str, logprobs: dict | None, finish_reason: str | None, tool_calls: Sequence[dict] = ()
    ) -> dict:
        return {"index": index, "text": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def final_choice(
        self, index: int, text: str, logprobs: dict | None, finish_reason: str | None, tool_calls: Sequence[dict] = ()
    ) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


class ChatFormat(CompletionFormat):
    """/v1/chat/completions: assistant messages and deltas, logprobs as a list of entries."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def opening_chunks(self, indices: list[int]) -> list[dict]:
        return [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in indices
        ]

    def logprobs(self, entries: LogprobEntries, offset: int = 0) -> dict:
        def entry(text: str, logprob: float) -> dict:
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        tok = self.token_text
        return {
            "content": [
                entry(t, lp.logprob) | {"top_logprobs": [entry(tok(i), v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                for t, lp in entries
                if lp is not None  # (chat echoes no prompt)
            ]
        }

    def stream_item(
        self, index: int, delta: str, logprobs: dict | None, finish_reason: str | None, tool_calls: Sequence[dict] = ()
    ) -> dict:
        """`tool_calls`: OpenAI's tool-call delta entries (gateway/tools/stream.py)."""
        out: dict = {"content": delta} if delta else {}
        if tool_calls:
            out["tool_calls"] = list(tool_calls)
        return {"index": index, "delta": out, "logprobs": logprobs, "finish_reason": finish_reason}

    def final_choice(
        self, index: int, text: str, logprobs: dict | None, finish_reason: str | None, tool_calls: Sequence[dict] = ()
    ) -> dict:
        """`tool_calls`: the calls read from the output; `text` is then what was outside them
        (content null when nothing was)."""
        message: dict = {"role": "assistant", "content": text}
        if tool_calls:
            message |= {"content": text or None, "tool_calls": list(tool_calls)}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


FORMATS = {"completion": CompletionFormat, "chat": ChatFormat}
