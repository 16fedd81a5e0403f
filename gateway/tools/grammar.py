"""Lark pieces for the grammars that force a call (llguidance's Lark: `%json {schema}` is a rule
bound to a JSON schema). Each parser composes them into its own format."""

from __future__ import annotations

import json

from pdserve.gateway.tools.request import Function

COMPACT = {"whitespace_flexible": False}  # as engine/structured/grammar.py's JSON: no free whitespace


def lit(text: str) -> str:
    """A Lark string literal (JSON escapes are valid Lark escapes)."""
    return json.dumps(text, ensure_ascii=False)


def json_rule(schema: dict | bool) -> str:
    """A rule body matching one JSON value valid against `schema`, written compactly."""
    body = schema if isinstance(schema, dict) else ({} if schema else {"not": {}})
    return "%json " + json.dumps({**body, "x-guidance": COMPACT}, ensure_ascii=False)


def calls_grammar(functions: list[Function], parallel: bool, call, *, open_: str, sep: str, close: str) -> str:
    """`open_ call (sep call)* close` (one call unless `parallel`), where `call(i, f)` gives
    the rules of function i (its first rule named `call_i`)."""
    alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
    more = f" ({lit(sep)} call)*" if parallel else ""
    rules = [f"start: {lit(open_)} call{more} {lit(close)}" if open_ or close else f"start: call{more}"]
    rules.append(f"call: {alternatives}")
    for i, f in enumerate(functions):
        rules.extend(call(i, f))
    return "\n".join(rules) + "\n"


def json_call(i: int, f: Function, *, args_key: str, before: str = "", after: str = "") -> list[str]:
    """`before{"name": "<f>", "<args_key>": <arguments>}after`, the arguments bound to f's schema."""
    head = before + "{" + f'"name": {json.dumps(f.name)}, "{args_key}": '
    return [f"call_{i}: {lit(head)} args_{i} {lit('}' + after)}", f"args_{i}: {json_rule(f.parameters)}"]
