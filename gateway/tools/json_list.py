"""Calls forced without --tool-call-parser, as vLLM forces them: for tool_choice `required` or a
named function, a grammar makes the whole output a JSON list of calls,
`[{"name": "f", "parameters": {...}}, ...]` (one call for a named function, or when
parallel_tool_calls is false), and this parser reads it back. It is no model's own format, so it
is never used for `auto` and is not one of --tool-call-parser's choices."""

from __future__ import annotations

from pdserve.gateway.tools.grammar import calls_grammar, json_call
from pdserve.gateway.tools.json_scan import CallObject, skip_ws
from pdserve.gateway.tools.parser import CallSoFar, Region, ToolParser
from pdserve.gateway.tools.request import Function

ARGS_KEYS = ("parameters", "arguments")


class JsonListParser(ToolParser):
    name = "json_list"

    def find_start(self, text: str, pos: int) -> int | None:
        if pos != 0:
            return None
        first = skip_ws(text, 0)
        return first if first < len(text) and text[first] == "[" else None

    def held_back(self, tail: str, at_start: bool) -> int:
        return 0  # the output is forced to open with the list

    def read_region(self, text: str, start: int, final: bool) -> Region:
        i = skip_ws(text, start + 1)
        calls: list[CallSoFar] = []
        while True:
            call = CallObject(text, i, ARGS_KEYS)
            if call.name is None:
                done = call.broken or call.end is not None or final
                if calls:
                    return Region("calls", calls, i if done else None)
                return Region("text" if done else "open")
            calls.append(CallSoFar(call.name, call.arguments(text)))
            if call.end is None:
                return Region("calls", calls)
            i = skip_ws(text, call.end)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
                continue
            if i < len(text) and text[i] == "]":
                return Region("calls", calls, i + 1)
            if i >= len(text) and not final:
                return Region("calls", calls)  # a `,` and another call may follow
            return Region("calls", calls, i)

    def grammar(self, functions: list[Function], parallel: bool) -> str:
        def call(i: int, f: Function) -> list[str]:
            return json_call(i, f, args_key="parameters")

        return calls_grammar(functions, parallel, call, open_="[", sep=", ", close="]")


FORCED_JSON = JsonListParser()  # the parser of calls forced without --tool-call-parser
