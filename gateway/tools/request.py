"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, and the tool turns of its
messages (assistant `tool_calls`, `role: "tool"` results), checked into plain data; a bad one is
a 400 naming its field."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pdserve.gateway.errors import invalid

TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}
NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None
    parameters: dict  # a JSON schema of the arguments object

    def template_entry(self) -> dict:
        """How chat templates take a tool (transformers' `tools=`: OpenAI's shape)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description is not None:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolRequest:
    functions: list[Function]
    choice: str  # "none", "auto", "required", or the name of the function that must be called
    parallel: bool  # more than one call in an answer

    @property
    def forced(self) -> list[Function]:
        """The functions a grammar makes the model call (none for `none` and `auto`)."""
        if self.choice == "required":
            return self.functions
        return [f for f in self.functions if f.name == self.choice]

    @property
    def parsed(self) -> bool:
        """The output is read for calls (any choice but `none`)."""
        return self.choice != "none"


def _function(tool: Any, i: int) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise invalid(f'\'{where}\' must be {{"type": "function", "function": {{...}}}}', "tools")
    if set(tool) - {"type", "function"}:
        raise invalid(f"'{where}': unexpected field '{sorted(set(tool) - {'type', 'function'})[0]}'", "tools")
    fn = tool["function"]
    if set(fn) - FUNCTION_KEYS:
        raise invalid(f"'{where}.function': unexpected field '{sorted(set(fn) - FUNCTION_KEYS)[0]}'", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise invalid(f"'{where}.function.name' must be 1-64 letters, digits, '_' or '-'", "tools")
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid(f"'{where}.function.description' must be a string", "tools")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise invalid(f"'{where}.function.strict' must be a boolean", "tools")
    parameters = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise invalid(f"'{where}.function.parameters' must be a JSON schema object", "tools")
    if parameters.get("type", "object") != "object":
        raise invalid(f"'{where}.function.parameters' must describe an object (type: object)", "tools")
    return Function(name, description, parameters)


def parse_tools(body: dict) -> ToolRequest | None:
    """The request's tools (None when it has none and tool_choice is absent or none)."""
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise invalid("'tools' must be a list", "tools")
    functions = [_function(t, i) for i, t in enumerate(tools or [])]
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise invalid("'tools': two functions have the same name", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if functions else "none"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        if set(choice) != {"type", "function"} or choice["type"] != "function" or not isinstance(fn, dict):
            raise invalid('\'tool_choice\' must be none, auto, required or {"type": "function", ...}', "tool_choice")
        if set(fn) != {"name"} or not isinstance(fn["name"], str):
            raise invalid("'tool_choice.function' must be {\"name\": ...}", "tool_choice")
        if fn["name"] not in names:
            raise invalid(f"'tool_choice': no function named '{fn['name']}' in 'tools'", "tool_choice")
        choice = fn["name"]
    elif choice not in ("none", "auto", "required"):
        raise invalid('\'tool_choice\' must be none, auto, required or {"type": "function", ...}', "tool_choice")
    elif choice != "none" and not functions:
        raise invalid(f"'tool_choice' is {choice} but 'tools' is empty", "tool_choice")
    if not functions:
        return None
    return ToolRequest(functions, choice, True if parallel is None else parallel)


def tool_message(m: dict, i: int) -> dict:
    """The tool fields of message i as chat templates take them (Hugging Face's convention):
    an assistant's `tool_calls` with their arguments as objects, a tool result's
    `tool_call_id`; {} for a message without any."""
    out: dict[str, Any] = {}
    where = f"messages[{i}]"
    if m["role"] == "tool":
        if not isinstance(m.get("tool_call_id"), str):
            raise invalid(f"'{where}': a tool message needs a string 'tool_call_id'", "messages")
        out["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    elif m.get("tool_call_id") is not None:
        raise invalid(f"'{where}': 'tool_call_id' belongs to a tool message", "messages")
    calls = m.get("tool_calls")
    if calls is None:
        return out
    if m["role"] != "assistant" or not isinstance(calls, list):
        raise invalid(f"'{where}.tool_calls' must be a list on an assistant message", "messages")
    out["tool_calls"] = [_template_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
    return out


def _template_call(call: Any, where: str) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if (
        not isinstance(fn, dict)
        or call.get("type", "function") != "function"
        or not isinstance(fn.get("name"), str)
        or not isinstance(fn.get("arguments"), str)
    ):
        raise invalid(f'\'{where}\' must be {{"type": "function", "function": {{name, arguments}}}}', "messages")
    try:
        arguments = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        raise invalid(f"'{where}.function.arguments' is not JSON", "messages") from None
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
