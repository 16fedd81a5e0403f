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
    if c.kind == "llguidance":
        return c.spec
    return m.grammar_from_lark(gbnf_to_lark(c.spec) if "::=" in c.spec else c.spec)


def check(c: StructuredOutput) -> None:
    """ValueError naming what is wrong with the constraint (schema, regex, grammar)."""
    error = llguidance.LLMatcher.validate_grammar(grammar_of(c))
    if error:
        raise ValueError(f"invalid {c.kind.replace('_', ' ')}: {error.strip()}")


def after_reasoning(c: StructuredOutput, opened: bool, start: str, end: str) -> StructuredOutput:
    """`c` applied once a thinking model's reasoning ends: free text up to the `end` marker (the
    output starts inside it when `opened`, else it may open with `start`), the blank lines a
    template puts after it (two at most: a model may loop on them), then what `c` allows.
    `start` / `end` are Lark: a string literal, or `<marker>` for a marker the tokenizer holds as
    one token (no regex can match one, so the free text ends there). Nothing but the end marker
    leaves the reasoning: end-of-sequence waits for the answer."""
    text = grammar_of(c)  # llguidance's grammar list as JSON, or (from Lark) the Lark text itself
    grammars = json.loads(text)["grammars"] if text.lstrip().startswith("{") else [{"lark_grammar": text}]
    answer = grammars[0].setdefault("name", "answer")
    # thinking: any bytes as the model writes them (a byte-level token may split a character), but
    # 0xff, which begins a special token's bytes in llguidance's vocabulary (so none passes as text)
    if end.startswith("<"):
        thinking = [f"thinking: /(?-u:[\\x00-\\xfe])*/ {end}"]
    else:
        thinking = [f"thinking[suffix={end}]: /(?-u:[\\x00-\\xfe])*/"]
    head = "thinking" if opened else f"({start} thinking)?"
    options = '%llguidance {"allow_invalid_utf8": true}'
    lark = "\n".join([options, f"start: {head} GAP @{answer}", *thinking, "GAP: /\\n{0,2}/"]) + "\n"
    top = {"grammars": [{"lark_grammar": lark}, *grammars]}
    return StructuredOutput("llguidance", json.dumps(top, ensure_ascii=False), c.resumed_tokens)
