"""A tool request at the gateway: every function's parameters schema compiled once (a bad one is
a 400 naming it), and for `required` or a named function the grammar of the call, which travels
to the workers as the request's StructuredOutput like any other constraint."""

from __future__ import annotations

import llguidance

from pdserve.gateway.errors import invalid
from pdserve.gateway.tools.grammar import json_rule
from pdserve.gateway.tools.json_list import FORCED_JSON
from pdserve.gateway.tools.parser import ToolParser
from pdserve.gateway.tools.request import ToolRequest
from pdserve.protocol.sampling import StructuredOutput


def _first_error_line(error: str) -> str:
    line = error.strip().splitlines()[0]
    return line.split(": ", 1)[1] if line.startswith("at ") and ": " in line else line


def call_reader(tools: ToolRequest | None, parser: ToolParser | None) -> ToolParser | None:
    """Who reads the output's calls: --tool-call-parser's parser, or, for a call forced without
    one, the JSON list's (json_list.py); None when the output is not read for calls."""
    if tools is None or not tools.parsed:
        return None
    if parser is not None:
        return parser
    return FORCED_JSON if tools.forced else None


def tool_constraint(
    tools: ToolRequest, parser: ToolParser | None, other: StructuredOutput | None
) -> StructuredOutput | None:
    """The constraint forcing the call (None for `none` and `auto`); 400 when a schema does not
    compile, `auto` has no parser to read calls with, or the request has another output constraint
    too. A forced call without --tool-call-parser is a JSON list of calls (json_list.py); a named
    function is called exactly once, `required` once or, with parallel_tool_calls, more."""
    for i, f in enumerate(tools.functions):
        error = llguidance.LLMatcher.validate_grammar("start: " + json_rule(f.parameters))
        if error:
            raise invalid(f"'tools[{i}].function.parameters': {_first_error_line(error)}", "tools")
    if not tools.parsed:
        return None
    if not tools.forced:
        if parser is None:
            raise invalid(
                f"tool_choice '{tools.choice}' needs a tool-call parser to read calls from the output: start the "
                "server with --tool-call-parser (tool_choice required or a named function works without one)",
                "tool_choice",
            )
        return None
    if other is not None:
        raise invalid("a forced tool call and an output constraint cannot be given together", "tool_choice")
    reader = parser or FORCED_JSON
    try:
        grammar = reader.grammar(tools.forced, tools.parallel and tools.choice == "required")
    except ValueError as e:
        raise invalid(f"'tool_choice': {e}", "tool_choice") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise invalid(f"'tool_choice': the call's grammar does not compile: {_first_error_line(error)}", "tool_choice")
    return StructuredOutput("lark", grammar)
