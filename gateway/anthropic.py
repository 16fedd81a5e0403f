"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the same
run as OpenAI's chat: the body (gateway/bodies.py `MessagesRequest`) maps onto the one internal
request (system and messages for the chat template, tool_use / tool_result blocks as the
template's assistant tool calls and tool messages, tools and tool_choice as chat's), and the run
is written in Anthropic's shapes: a message with text and tool_use blocks, `stop_reason`
(end_turn, max_tokens, stop_sequence with `stop_sequence`, tool_use), `usage`, and when streamed
the SSE events message_start, content_block_start / content_block_delta (text_delta,
input_json_delta) / content_block_stop, message_delta, message_stop. Errors are Anthropic's
`{"type": "error", "error": {"type", "message"}}`; the API key may come as `x-api-key`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.gateway.bodies import (
    AnthropicText,
    AnthropicTextPart,
    AnthropicTool,
    AnthropicToolChoice,
    AnthropicToolResult,
    AnthropicToolUse,
    Bounds,
    CountTokensRequest,
    MessagesRequest,
    decode,
)
from pdserve.gateway.dialects import Dialect
from pdserve.gateway.errors import APIError, invalid
from pdserve.gateway.generation import Choice, GenerationRun
from pdserve.gateway.schemas import ParsedRequest, apply_constraints
from pdserve.gateway.tools.parser import ToolParser
from pdserve.gateway.tools.request import NAME, Function, ToolRequest

if TYPE_CHECKING:
    from pdserve.gateway.app import GatewayApp

_json = msgspec.json.Encoder().encode
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error(e: APIError) -> Response:
    return JSONResponse(error_body(e.status, e.message), status_code=e.status, headers=e.headers)


def _text(content: str | list[AnthropicTextPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text for b in content)


def template_messages(system: str | list[AnthropicTextPart] | None, body: MessagesRequest | CountTokensRequest) -> list:
    """The conversation as chat templates take it (OpenAI's roles, Hugging Face's tool turns):
    a user turn's tool_result blocks become tool messages before its text, an assistant turn's
    tool_use blocks its tool calls (arguments as objects)."""
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": _text(system)})
    for m in body.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        texts = [b.text for b in m.content if isinstance(b, AnthropicText)]
        if m.role == "assistant":
            calls = [
                {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                for b in m.content
                if isinstance(b, AnthropicToolUse)
            ]
            if any(isinstance(b, AnthropicToolResult) for b in m.content):
                raise invalid("tool_result blocks belong to user messages", "messages")
            out.append({"role": "assistant", "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
            continue
        if any(isinstance(b, AnthropicToolUse) for b in m.content):
            raise invalid("tool_use blocks belong to assistant messages", "messages")
        for b in m.content:
            if isinstance(b, AnthropicToolResult):
                result = _text(b.content)
                out.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": result})
        if texts or not any(isinstance(b, AnthropicToolResult) for b in m.content):
            out.append({"role": "user", "content": "".join(texts)})
    return out


def tool_request(tools: list[AnthropicTool] | None, choice: AnthropicToolChoice | None) -> ToolRequest | None:
    """Anthropic's tools and tool_choice as chat's: auto, any (required), tool (a named function),
    none; disable_parallel_tool_use: one call."""
    if not tools:
        if choice is not None and choice.type not in ("auto", "none"):
            raise invalid(f"tool_choice '{choice.type}' needs tools", "tool_choice")
        return None
    functions = []
    for i, t in enumerate(tools):
        if not NAME.fullmatch(t.name):
            raise invalid(f"'tools[{i}].name' must be 1-64 letters, digits, '_' or '-'", "tools")
        if t.input_schema.get("type", "object") != "object":
            raise invalid(f"'tools[{i}].input_schema' must describe an object (type: object)", "tools")
        functions.append(Function(t.name, t.description, t.input_schema))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise invalid("'tools': two tools have the same name", "tools")
    kind = "auto" if choice is None else choice.type
    name = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        if choice is None or choice.name not in names:
            raise invalid(f"'tool_choice.name': no tool named '{choice.name if choice else None}'", "tool_choice")
        name = choice.name
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    assert name is not None
    return ToolRequest(functions, name, parallel)


class MessagesDialect(Dialect):
    def __init__(self) -> None:
        super().__init__("chat")
        self.id_prefix = "msg_"

    def parse(self, body: Any, bounds: Bounds, tool_parser: ToolParser | None) -> ParsedRequest:
        m = decode(body, MessagesRequest, bounds)
        req = ParsedRequest(kind="chat", model=m.model)
        req.messages = template_messages(m.system, m)
        req.max_tokens = m.max_tokens
        req.stream = bool(m.stream)
        req.stop = list(m.stop_sequences or [])
        req.sampling = {k: v for k in ("temperature", "top_p", "top_k") if (v := getattr(m, k)) is not None}
        req.tools = tool_request(m.tools, m.tool_choice)
        req.splits_reasoning = True  # thinking blocks under --reasoning-parser (`thinking` itself changes nothing)
        fmt = m.output_config.format if m.output_config is not None else None
        schema = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema}} if fmt else None
        apply_constraints(req, {"response_format": schema}, tool_parser)
        return req

    def error(self, e: APIError) -> Response:
        return anthropic_error(e)

    async def respond(self, run: GenerationRun, first: Any, request: Request) -> Response:
        outcome = await run.drain(first, request)
        if isinstance(outcome, APIError):
            return self.error(outcome)
        if outcome is not None:
            return outcome
        choice = run.choices[0]
        text, calls = run.final_text(choice)
        reasoning = run.final_reasoning(choice)
        content: list[dict] = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning else []
        content += [{"type": "text", "text": text}] if text or not calls else []
        content += [
            {
                "type": "tool_use",
                "id": tool_use_id(c["id"]),
                "name": c["function"]["name"],
                "input": _input(c["function"]["arguments"]),
            }
            for c in calls
        ]
        reason, stop_sequence = stop_reason(choice, bool(calls))
        return JSONResponse(
            message(run)
            | {"content": content, "stop_reason": reason, "stop_sequence": stop_sequence}
            | {"usage": usage(run, choice.num_tokens)}
        )

    def sse(self, run: GenerationRun, first: Any) -> AsyncGenerator[bytes, None]:
        return _events(run, first)


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict:
    """A call's arguments (forced calls are valid JSON; a model's own may not be: {} then)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(choice: Choice, called: bool) -> tuple[str | None, str | None]:
    if choice.finish_reason == "length":
        return "max_tokens", None
    if choice.stop.hit is not None:
        return "stop_sequence", choice.stop.hit
    return ("tool_use" if called else "end_turn"), None


def message(run: GenerationRun) -> dict:
    return {"id": run.base_id, "type": "message", "role": "assistant", "model": run.ctx.model_name}


def usage(run: GenerationRun, output_tokens: int) -> dict:
    cached = run.choices[0].cached_tokens
    return {
        "input_tokens": len(run.prompt) - cached,
        "output_tokens": output_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _event(name: str, data: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + _json(data) + b"\n\n"


async def _events(run: GenerationRun, first: Any) -> AsyncGenerator[bytes, None]:
    """The streamed message: thinking (under --reasoning-parser), text and tool_use blocks as they
    come (a block stops when the next starts), then message_delta with the stop reason and usage,
    and message_stop."""
    choice = run.choices[0]
    block = -1  # the open block's index
    open_kind: str | None = None  # "thinking", "text" or "tool_use": the block still open
    calls: dict[int, int] = {}  # tool call index -> its block's index

    def start(kind: str, content_block: dict) -> list[bytes]:
        nonlocal block, open_kind
        out = [_event("content_block_stop", {"type": "content_block_stop", "index": block})] if block >= 0 else []
        block += 1
        open_kind = kind
        body = {"type": "content_block_start", "index": block, "content_block": content_block}
        return [*out, _event("content_block_start", body)]

    def piece(index: int, delta: dict) -> bytes:
        return _event("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    try:
        begin = message(run) | {"content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(run, 0)}
        yield _event("message_start", {"type": "message_start", "message": begin})
        async for _, delta, _, reason in run.events(first):
            if reason == "error":
                body = error_body(500, choice.error or "generation failed")
                yield _event("error", body)
                return
            thought = ""
            if choice.reasoning is not None:  # the reasoning apart (--reasoning-parser)
                thought, delta = choice.reasoning.feed(delta, final=reason is not None)
            if thought:
                if open_kind != "thinking":
                    for chunk in start("thinking", {"type": "thinking", "thinking": "", "signature": ""}):
                        yield chunk
                yield piece(block, {"type": "thinking_delta", "thinking": thought})
            entries: list[dict] = []
            if choice.tools is not None:
                delta, entries = choice.tools.feed(delta, final=reason is not None)
            if delta:
                if open_kind != "text":
                    for chunk in start("text", {"type": "text", "text": ""}):
                        yield chunk
                yield piece(block, {"type": "text_delta", "text": delta})
            for entry in entries:
                if "id" in entry:  # a new call: the open block ends
                    use = {"type": "tool_use", "id": tool_use_id(entry["id"]), "name": entry["function"]["name"]}
                    for chunk in start("tool_use", use | {"input": {}}):
                        yield chunk
                    calls[entry["index"]] = block
                elif entry["function"].get("arguments"):
                    partial = {"type": "input_json_delta", "partial_json": entry["function"]["arguments"]}
                    yield piece(calls[entry["index"]], partial)
            if reason is not None:
                if open_kind in (None, "thinking") and not calls:  # an answer always has its text block
                    for chunk in start("text", {"type": "text", "text": ""}):
                        yield chunk
                yield _event("content_block_stop", {"type": "content_block_stop", "index": block})
                stop, sequence = stop_reason(choice, bool(calls))
                yield _event(
                    "message_delta",
                    {
                        "type": "message_delta",
                        "delta": {"stop_reason": stop, "stop_sequence": sequence},
                        "usage": {"output_tokens": choice.num_tokens},
                    },
                )
                yield _event("message_stop", {"type": "message_stop"})
    finally:
        await run.close()


MESSAGES = MessagesDialect()


async def count_tokens(gw: GatewayApp, request: Request) -> Response:
    """`POST /v1/messages/count_tokens`: the prompt's tokens as /v1/messages would send them."""
    body = decode(await gw.read_json(request), CountTokensRequest, gw.bounds)
    gw.check_model(body.model)
    messages = template_messages(body.system, body)
    ids = await asyncio.to_thread(gw.chat_ids, messages, tool_request(body.tools, body.tool_choice))
    return JSONResponse({"input_tokens": len(ids)})
