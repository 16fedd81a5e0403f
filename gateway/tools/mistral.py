"""Mistral: `[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...]` (a JSON list after the
marker); text before the marker is content."""

from __future__ import annotations

from pdserve.gateway.tools.grammar import calls_grammar, json_call
from pdserve.gateway.tools.json_scan import CallObject, skip_ws
from pdserve.gateway.tools.parser import CallSoFar, Region, ToolParser, suffix_prefix_len
from pdserve.gateway.tools.request import Function

MARKER = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (MARKER,)

    def find_start(self, text: str, pos: int) -> int | None:
        i = text.find(MARKER, pos)
        return None if i < 0 else i

    def held_back(self, tail: str, at_start: bool) -> int:
        return suffix_prefix_len(tail, MARKER)

    def read_region(self, text: str, start: int, final: bool) -> Region:
        i = skip_ws(text, start + len(MARKER))
        undecided = Region("text" if final else "open")
        if i >= len(text):
            return undecided
        if text[i] != "[":
            return Region("text", end=i)
        calls: list[CallSoFar] = []
        i = skip_ws(text, i + 1)
        while True:
            call = CallObject(text, i, ("arguments",))
            if call.name is None:
                done = call.broken or call.end is not None or final
                if calls:  # what follows the calls is content (once it is known to be no call)
                    return Region("calls", calls, i if done else None)
                return Region("text", end=i) if done else undecided
            calls.append(CallSoFar(call.name, call.arguments(text)))
            if call.end is None:
                return Region("calls", calls)
            i = skip_ws(text, call.end)
            if i >= len(text):
                return Region("calls", calls, None if not final else i)
            if text[i] == "]":
                return Region("calls", calls, i + 1)
            if text[i] != ",":
                return Region("calls", calls, i)
            i = skip_ws(text, i + 1)

    def grammar(self, functions: list[Function], parallel: bool) -> str:
        def call(i: int, f: Function) -> list[str]:
            return json_call(i, f, args_key="arguments")

        return calls_grammar(functions, parallel, call, open_=MARKER + "[", sep=", ", close="]")
