"""Llama 3.1-3.3 JSON calls: the output is `{"name": "f", "parameters": {...}}` (several joined
by `; `), possibly after `<|python_tag|>`; an output not starting so is content."""

from __future__ import annotations

from pdserve.gateway.tools.grammar import calls_grammar, json_call
from pdserve.gateway.tools.json_scan import CallObject, skip_ws
from pdserve.gateway.tools.parser import CallSoFar, Region, ToolParser, suffix_prefix_len
from pdserve.gateway.tools.request import Function

PYTHON_TAG = "<|python_tag|>"
ARGS_KEYS = ("parameters", "arguments")


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def find_start(self, text: str, pos: int) -> int | None:
        i = text.find(PYTHON_TAG, pos)
        if pos == 0:
            first = skip_ws(text, 0)
            if first < len(text) and text[first] == "{" and (i < 0 or first < i):
                return first
        return None if i < 0 else i

    def held_back(self, tail: str, at_start: bool) -> int:
        return suffix_prefix_len(tail, PYTHON_TAG)

    def read_region(self, text: str, start: int, final: bool) -> Region:
        i = skip_ws(text, start + len(PYTHON_TAG) if text.startswith(PYTHON_TAG, start) else start)
        calls: list[CallSoFar] = []
        while True:
            call = CallObject(text, i, ARGS_KEYS)
            if call.name is None:
                done = call.broken or call.end is not None or final
                if calls:  # what follows the calls is content (once it is known to be no call)
                    return Region("calls", calls, i if done else None)
                return Region("text" if done else "open")
            calls.append(CallSoFar(call.name, call.arguments(text)))
            if call.end is None:
                return Region("calls", calls)
            i = skip_ws(text, call.end)
            if i < len(text) and text[i] == ";":
                j = skip_ws(text, i + 1)
                if j >= len(text) or text[j] == "{":
                    i = j
                    continue
            if i >= len(text) and not final:
                return Region("calls", calls)  # a `;` and another call may follow
            return Region("calls", calls, i)

    def grammar(self, functions: list[Function], parallel: bool) -> str:
        def call(i: int, f: Function) -> list[str]:
            return json_call(i, f, args_key="parameters")

        return calls_grammar(functions, parallel, call, open_="", sep="; ", close="")
