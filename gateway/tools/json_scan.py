"""Where a JSON value ends in text still being generated: tolerant scanning (what is inside a
value is not validated), so a call's raw argument text can stream out before it is complete."""

from __future__ import annotations

import json
import re

_WS = re.compile(r"\s*")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
# a complete string, an unterminated one (the text ends inside it), a bracket, or a run of other text
_PIECE = re.compile(r'(?P<str>"(?:[^"\\]|\\.)*")|(?P<open>"(?:[^"\\]|\\.)*\\?\Z)|[\[\]{}]|[^"\[\]{}]+', re.S)
_SCALAR = re.compile(r"[^,}\]\s]*")


def skip_ws(text: str, i: int) -> int:
    m = _WS.match(text, i)
    assert m is not None
    return m.end()


def value_end(text: str, start: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[start], None while it is not closed.
    Objects and arrays end at their matching bracket, strings at their closing quote, a bare
    scalar at the first `,`, `}`, `]` or whitespace after it."""
    if start >= len(text):
        return None
    c = text[start]
    if c == '"':
        m = _STRING.match(text, start)
        return m.end() if m else None
    if c in "{[":
        depth = 0
        for m in _PIECE.finditer(text, start):
            if m.group("open") is not None:
                return None
            piece = m.group()
            if piece in ("{", "["):
                depth += 1
            elif piece in ("}", "]"):
                depth -= 1
                if depth == 0:
                    return m.end()
        return None
    m = _SCALAR.match(text, start)
    assert m is not None
    return m.end() if m.end() < len(text) else None


class CallObject:
    """A call written as a JSON object (`{"name": "f", "arguments": {...}}`), scanned as far as
    the text goes: the name once its string is complete, the raw span of the arguments value."""

    def __init__(self, text: str, start: int, args_keys: tuple[str, ...]) -> None:
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.end: int | None = None  # after the closing brace, once seen
        self.broken = False  # not a JSON object of string keys (so not a call)
        self._scan(text, start, args_keys)

    def arguments(self, text: str) -> str:
        """The arguments' raw JSON text so far; "{}" for a closed call without any."""
        if self.args_start is None:
            return "{}" if self.end is not None else ""
        return text[self.args_start : self.args_end if self.args_end is not None else len(text)]

    def _scan(self, text: str, i: int, args_keys: tuple[str, ...]) -> None:
        n = len(text)
        if i >= n or text[i] != "{":
            self.broken = i < n
            return
        i += 1
        while True:
            i = skip_ws(text, i)
            if i >= n:
                return
            if text[i] == "}":
                self.end = i + 1
                return
            key_end = value_end(text, i) if text[i] == '"' else None
            if text[i] != '"' or key_end is None:
                self.broken = text[i] != '"'
                return
            try:
                key = json.loads(text[i:key_end])
            except ValueError:
                self.broken = True
                return
            i = skip_ws(text, key_end)
            if i >= n:
                return
            if text[i] != ":":
                self.broken = True
                return
            i = skip_ws(text, i + 1)
            if i >= n:
                return
            end = value_end(text, i)
            if key in args_keys:
                self.args_start, self.args_end = i, end
            if end is None:
                return
            if key == "name":
                try:
                    name = json.loads(text[i:end])
                except ValueError:
                    name = None
                if not isinstance(name, str):
                    self.broken = True
                    return
                self.name = name
            i = skip_ws(text, end)
            if i >= n:
                return
            if text[i] == "}":
                self.end = i + 1
                return
            if text[i] != ",":
                self.broken = True
                return
            i += 1
