"""A choice's output read for tool calls as it streams: each new piece of text becomes OpenAI's
delta (content outside the calls; per call a first entry with `index`, `id`, `type` and
`function.name` with empty arguments, then `function.arguments` in pieces), and the whole
output its message. The parser rescans the text so far on each piece (parser.py: each scan only
extends the previous one), so what was streamed adds up to the non-streamed answer."""

from __future__ import annotations

import uuid

from pdserve.gateway.tools.parser import Parsed, ToolParser


def call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def message_calls(parsed: Parsed) -> list[dict]:
    """OpenAI's `message.tool_calls` of a whole output."""
    return [
        {"id": call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in parsed.calls
    ]


class ToolCallStream:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content = ""  # the content sent so far
        self.arguments: list[str] = []  # each call's arguments sent so far
        self.ids: list[str] = []

    @property
    def has_calls(self) -> bool:
        return bool(self.ids)

    def feed(self, piece: str, final: bool) -> tuple[str, list[dict]]:
        """(content delta, tool_calls delta entries, one per chunk) for `piece`; `final`: the
        output ended."""
        self.text += piece
        now = self.parser.scan(self.text, final)
        content = ""
        if now.content.startswith(self.content):
            content, self.content = now.content[len(self.content) :], now.content
        entries: list[dict] = []
        for i, call in enumerate(now.calls):
            if i == len(self.ids):
                self.ids.append(call_id())
                self.arguments.append("")
                first = {"name": call.name, "arguments": ""}
                entries.append({"index": i, "id": self.ids[i], "type": "function", "function": first})
            sent = self.arguments[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                entries.append({"index": i, "function": {"arguments": call.arguments[len(sent) :]}})
                self.arguments[i] = call.arguments
        return content, entries
