"""Pythonic calls (Llama 3.2 / 4, ToolACE): the output is a Python list of calls,
`[f(a=1), g(b="x")]`, keyword arguments only; an output not starting so is content. A call is
listed once its closing parenthesis is read (its arguments, converted to JSON, come whole)."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pdserve.gateway.tools.grammar import calls_grammar, json_rule, lit
from pdserve.gateway.tools.json_scan import skip_ws
from pdserve.gateway.tools.parser import CallSoFar, Region, ToolParser
from pdserve.gateway.tools.request import Function

_HEAD = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
_HEAD_SO_FAR = re.compile(r"[A-Za-z_][\w.]*\s*\Z")  # a head cut short by the end of the text
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
# a string literal (either quote, escapes), a bracket, or a run of anything else
_PIECE = re.compile(r"""(?P<str>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')|[()\[\]{}]|[^"'()\[\]{}]+|["']""", re.S)


def _call_end(text: str, open_paren: int) -> int | None:
    """After the `)` matching text[open_paren], None while it is not written yet."""
    depth = 0
    for m in _PIECE.finditer(text, open_paren):
        piece = m.group()
        if m.group("str") is None and piece in "\"'":
            return None  # a string still open
        if piece in ("(", "[", "{"):
            depth += 1
        elif piece in (")", "]", "}"):
            depth -= 1
            if depth == 0:
                return m.end() if piece == ")" else None
    return None


def _value(source: str) -> Any:
    """A keyword's value: JSON (true, null, JSON escapes) or a Python literal."""
    try:
        return json.loads(source)
    except ValueError:
        return ast.literal_eval(source)


def _arguments(call_text: str) -> str | None:
    """`f(a=1, b="x")` -> '{"a": 1, "b": "x"}', None when it is no call of literals."""
    try:
        node = ast.parse(call_text, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        args = {}
        for kw in node.keywords:
            source = ast.get_source_segment(call_text, kw.value)
            if kw.arg is None or source is None:
                return None
            args[kw.arg] = _value(source)
        return json.dumps(args, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, MemoryError, RecursionError):
        return None


class PythonicParser(ToolParser):
    name = "pythonic"

    def find_start(self, text: str, pos: int) -> int | None:
        first = skip_ws(text, pos)
        return first if pos == 0 and first < len(text) and text[first] == "[" else None

    def held_back(self, tail: str, at_start: bool) -> int:
        return len(tail) if at_start and not tail.strip() else 0

    def read_region(self, text: str, start: int, final: bool) -> Region:
        calls: list[CallSoFar] = []
        i = skip_ws(text, start + 1)
        while True:
            head = _HEAD.match(text, i)
            if head is None:
                cut_short = not final and (i >= len(text) or _HEAD_SO_FAR.match(text, i) is not None)
                return self._stop(calls, i, cut_short)
            end = _call_end(text, head.end() - 1)
            if end is None:
                return self._stop(calls, i, cut_short=not final)
            arguments = _arguments(text[i:end])
            if arguments is None:
                return self._stop(calls, i, cut_short=False)
            calls.append(CallSoFar(head.group(1), arguments))
            i = skip_ws(text, end)
            if i < len(text) and text[i] == "]":
                return Region("calls", calls, i + 1)
            if i < len(text) and text[i] == ",":
                i = skip_ws(text, i + 1)
                continue
            return self._stop(calls, i, cut_short=not final and i >= len(text))

    @staticmethod
    def _stop(calls: list[CallSoFar], i: int, cut_short: bool) -> Region:
        """The list reads no further at i: still being written (`cut_short`), or done."""
        if cut_short:
            return Region("calls", calls) if calls else Region("open")
        return Region("calls", calls, i) if calls else Region("text")

    def grammar(self, functions: list[Function], parallel: bool) -> str:
        for f in functions:
            if not _IDENTIFIER.fullmatch(f.name):
                raise ValueError(f"function '{f.name}' is no Python identifier: the pythonic format cannot call it")

        def call(i: int, f: Function) -> list[str]:
            return [f"call_{i}: {lit(f.name + '(')} kwargs_{i} {lit(')')}", *_kwargs_rules(i, f.parameters)]

        return calls_grammar(functions, parallel, call, open_="[", sep=", ", close="]")


def _kwargs_rules(i: int, schema: dict) -> list[str]:
    """The keyword arguments of function i in the order of its schema's properties, the required
    ones always, the others optionally; `first_k` / `next_k`: from property k on, with nothing
    / something before (so a comma goes before it)."""
    properties: dict = dict(schema.get("properties") or {})
    for name in schema.get("required") or []:
        properties.setdefault(name, True)
    required = set(schema.get("required") or [])
    names = list(properties)
    rules = []
    for k, name in enumerate(names):
        if not _IDENTIFIER.fullmatch(name):
            raise ValueError(f"argument '{name}' is no Python identifier: the pythonic format cannot pass it")
        rules.append(f"arg_{i}_{k}: {lit(name + '=')} value_{i}_{k}")
        rules.append(f"value_{i}_{k}: {json_rule(properties[name])}")
        last = k == len(names) - 1
        rest_first, rest_next = ('""', '""') if last else (f"first_{i}_{k + 1}", f"next_{i}_{k + 1}")
        take_first, take_next = f"arg_{i}_{k} {rest_next}", f'", " arg_{i}_{k} {rest_next}'
        if name in required:
            rules += [f"first_{i}_{k}: {take_first}", f"next_{i}_{k}: {take_next}"]
        else:
            rules += [f"first_{i}_{k}: {take_first} | {rest_first}", f"next_{i}_{k}: {take_next} | {rest_next}"]
    rules.append(f"kwargs_{i}: first_{i}_0" if names else f'kwargs_{i}: ""')
    return rules
