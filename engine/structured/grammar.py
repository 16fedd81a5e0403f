"""A request's constraint (protocol/sampling.py StructuredOutput) as an llguidance grammar.

Torch-free: the gateway checks constraints with `check` before any work leaves it (the same
compiler the workers run, so a constraint it passes compiles there too).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
from llguidance.gbnf_to_lark import gbnf_to_lark

from pdserve.protocol.sampling import StructuredOutput

# Compact JSON (", " and ": " between items, no other whitespace): free whitespace lets a model
# loop on newlines until max_tokens (a known failure of small models under JSON constraints).
JSON_OPTIONS: Any = {"whitespace_flexible": False}  # llguidance's JsonCompileOptions


def _lark_literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a Lark string literal: JSON escapes are valid


def grammar_of(c: StructuredOutput) -> str:
    """The llguidance grammar text; ValueError when the spec is not of its kind's shape."""
    m = llguidance.LLMatcher
    if c.kind == "json_object":
        return m.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if c.kind == "json_schema":
        try:
            schema = json.loads(c.spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError("a JSON schema must be an object")
        return m.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if c.kind == "regex":
        return m.grammar_from_regex(c.spec)
    if c.kind == "choice":
        choices = json.loads(c.spec)
        if not isinstance(choices, list) or not choices or not all(isinstance(x, str) and x for x in choices):
            raise ValueError("choice needs a non-empty list of non-empty strings")
        return m.grammar_from_lark("start: " + " | ".join(_lark_literal(x) for x in choices))
    if c.kind == "lark":
        return m.grammar_from_lark(c.spec)
    return m.grammar_from_lark(gbnf_to_lark(c.spec) if "::=" in c.spec else c.spec)


def check(c: StructuredOutput) -> None:
    """ValueError naming what is wrong with the constraint (schema, regex, grammar)."""
    error = llguidance.LLMatcher.validate_grammar(grammar_of(c))
    if error:
        raise ValueError(f"invalid {c.kind.replace('_', ' ')}: {error.strip()}")
