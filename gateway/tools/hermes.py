"""Hermes / Qwen 2.5 and 3: `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`, one
tag per call, text around the tags is content."""

from __future__ import annotations

from pdserve.gateway.tools.grammar import calls_grammar, json_call
from pdserve.gateway.tools.json_scan import CallObject, skip_ws
from pdserve.gateway.tools.parser import CallSoFar, Region, ToolParser, suffix_prefix_len
from pdserve.gateway.tools.request import Function

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (OPEN, CLOSE)

    def find_start(self, text: str, pos: int) -> int | None:
        i = text.find(OPEN, pos)
        return None if i < 0 else i

    def held_back(self, tail: str, at_start: bool) -> int:
        return suffix_prefix_len(tail, OPEN)

    def read_region(self, text: str, start: int, final: bool) -> Region:
        close = text.find(CLOSE, start + len(OPEN))
        body = text if close < 0 else text[:close]  # the call's JSON stops at the closing tag
        end = None if close < 0 else close + len(CLOSE)
        call = CallObject(body, skip_ws(body, start + len(OPEN)), ("arguments",))
        if call.name is not None:
            return Region("calls", [CallSoFar(call.name, call.arguments(body))], end)
        if call.broken or call.end is not None or end is not None or final:
            return Region("text", end=end)
        return Region("open")

    def grammar(self, functions: list[Function], parallel: bool) -> str:
        def call(i: int, f: Function) -> list[str]:
            return json_call(i, f, args_key="arguments", before=OPEN + "\n", after="\n" + CLOSE)

        return calls_grammar(functions, parallel, call, open_="", sep="\n", close="")
