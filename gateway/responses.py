"""OpenAI's Responses API (`POST /v1/responses`), stateless: nothing is stored (`store` is
accepted and answered false; `previous_response_id` is a 400: send the whole conversation as
`input`). The body (gateway/bodies.py `ResponsesRequest`) maps onto the one internal request as
chat does: `instructions` a system message, `input` text or items (messages, and earlier
function_call / function_call_output items as the template's assistant tool calls and tool
messages), function `tools` and `tool_choice` as chat's (forced calls without a parser too),
`text.format` as response_format, `max_output_tokens`, the sampling fields. The answer is a
`response` object with message and function_call output items and `usage`; streamed, the event
sequence the SDK expects: response.created, response.in_progress, per item
response.output_item.added, (text) response.content_part.added, response.output_text.delta ...,
response.output_text.done, response.content_part.done, (call)
response.function_call_arguments.delta ... .done, response.output_item.done, then
response.completed (response.incomplete when max_output_tokens cut it), each with its
sequence_number.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.gateway.bodies import (
    RESPONSE_ITEMS,
    Bounds,
    FormatJsonObject,
    FormatJsonSchema,
    ResponseFunctionCall,
    ResponseFunctionCallOutput,
    ResponseInputMessage,
    ResponseInputText,
    ResponsesRequest,
    ResponseText,
    decode,
)
from pdserve.gateway.dialects import Dialect
from pdserve.gateway.errors import APIError, invalid
from pdserve.gateway.generation import GenerationRun
from pdserve.gateway.schemas import ParsedRequest, apply_constraints, sampling_fields
from pdserve.gateway.tools.parser import ToolParser
from pdserve.gateway.tools.request import NAME, Function, ToolRequest

_json = msgspec.json.Encoder().encode


def _text(content: str | list[ResponseInputText]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


def _items(value: Any) -> list[Any]:
    """`input` as typed items (a message's `type` may be left out); 400 naming the item."""
    if isinstance(value, str):
        return [ResponseInputMessage(role="user", content=value)]
    if not isinstance(value, list):
        raise invalid("'input' must be a string or a list of items", "input")
    items = []
    for i, item in enumerate(value):
        kind = (item.get("type") or "message") if isinstance(item, dict) else None  # (null: a message)
        if not isinstance(kind, str) or kind not in RESPONSE_ITEMS:
            raise invalid(f"'input[{i}]' must be a message, function_call or function_call_output item", "input")
        try:
            items.append(msgspec.convert(item, RESPONSE_ITEMS[kind]))
        except msgspec.ValidationError as e:
            raise invalid(f"'input[{i}]': {e}", "input") from None
    return items


def template_messages(instructions: str | None, items: list[Any]) -> list[dict]:
    """The conversation as chat templates take it: consecutive function_call items join one
    assistant turn (after its text, if the turn before was the assistant's), outputs are tool turns."""
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        if isinstance(item, ResponseInputMessage):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, ResponseFunctionCall):
            try:
                arguments = json.loads(item.arguments) if item.arguments else {}
            except json.JSONDecodeError:
                raise invalid(f"the arguments of function_call '{item.call_id}' are not JSON", "input") from None
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        else:
            assert isinstance(item, ResponseFunctionCallOutput)
            output = item.output if isinstance(item.output, str) else _text(item.output)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return out


def _response_format(text: ResponseText | None) -> dict | None:
    fmt = text.format if text is not None else None
    if isinstance(fmt, FormatJsonObject):
        return {"type": "json_object"}
    if isinstance(fmt, FormatJsonSchema):
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema}}
    return None


class ResponsesDialect(Dialect):
    def __init__(self) -> None:
        super().__init__("chat")
        self.id_prefix = "resp_"

    def parse(self, body: Any, bounds: Bounds, tool_parser: ToolParser | None) -> ParsedRequest:
        r = decode(body, ResponsesRequest, bounds)
        if r.previous_response_id is not None:
            raise invalid(
                "previous_response_id is not supported: this server stores no responses; send the whole "
                "conversation as input",
                "previous_response_id",
            )
        req = ParsedRequest(kind="chat", model=r.model, sampling=sampling_fields(r))
        req.messages = template_messages(r.instructions, _items(r.input))
        req.max_tokens = r.max_output_tokens
        req.stream = bool(r.stream)
        req.stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
        req.tools = _tools(r)
        req.splits_reasoning = True  # (a reasoning item under --reasoning-parser)
        req.source = r  # what the answer repeats of the request
        apply_constraints(req, {"response_format": _response_format(r.text)}, tool_parser)
        return req

    async def respond(self, run: GenerationRun, first: Any, request: Request) -> Response:
        outcome = await run.drain(first, request)
        if isinstance(outcome, APIError):
            return outcome.response()
        if outcome is not None:
            return outcome
        text, calls = run.final_text(run.choices[0])
        output = []
        reasoning = run.final_reasoning(run.choices[0])
        if reasoning:
            output.append(_reasoning_item("rs_" + uuid.uuid4().hex, reasoning, "completed"))
        if text or not calls:
            output.append(_message_item("msg_" + uuid.uuid4().hex, text, "completed"))
        output += [
            _call_item(
                "fc_" + uuid.uuid4().hex, c["id"], c["function"]["name"], c["function"]["arguments"], "completed"
            )
            for c in calls
        ]
        return JSONResponse(response_object(run, _status(run), output))

    def sse(self, run: GenerationRun, first: Any) -> AsyncGenerator[bytes, None]:
        return _events(run, first)


def _tools(r: ResponsesRequest) -> ToolRequest | None:
    """Responses' function tools and tool_choice as chat's."""
    choice = r.tool_choice
    if not r.tools:
        if choice not in (None, "none", "auto"):
            raise invalid("'tool_choice' names a tool but 'tools' is empty", "tool_choice")
        return None
    functions = []
    for i, t in enumerate(r.tools):
        parameters = t.parameters if t.parameters is not None else {"type": "object", "properties": {}}
        if not NAME.fullmatch(t.name):
            raise invalid(f"'tools[{i}].name' must be 1-64 letters, digits, '_' or '-'", "tools")
        if parameters.get("type", "object") != "object":
            raise invalid(f"'tools[{i}].parameters' must describe an object (type: object)", "tools")
        functions.append(Function(t.name, t.description, parameters))
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise invalid("'tools': two functions have the same name", "tools")
    name: str
    if choice is None or isinstance(choice, str):
        name = choice or "auto"
    else:
        if choice.name not in names:
            raise invalid(f"'tool_choice': no function named '{choice.name}' in 'tools'", "tool_choice")
        name = choice.name
    return ToolRequest(functions, name, r.parallel_tool_calls is not False)


def _status(run: GenerationRun) -> str:
    return "incomplete" if run.choices[0].finish_reason == "length" else "completed"


def _message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def response_object(run: GenerationRun, status: str, output: list[dict]) -> dict:
    r: ResponsesRequest = run.req.source
    completion = run.choices[0].num_tokens
    cached = run.choices[0].cached_tokens
    tools = [
        {
            "type": "function",
            "name": f.name,
            "description": f.description,
            "parameters": f.parameters,
            "strict": False,
        }
        for f in (run.req.tools.functions if run.req.tools is not None else [])
    ]
    choice = r.tool_choice
    return {
        "id": run.base_id,
        "object": "response",
        "created_at": run.created,
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": r.instructions,
        "max_output_tokens": r.max_output_tokens,
        "model": run.ctx.model_name,
        "output": output,
        "parallel_tool_calls": r.parallel_tool_calls is not False,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": False,
        "temperature": run.sampling.temperature,
        "text": {"format": msgspec.to_builtins(r.text.format) if r.text and r.text.format else {"type": "text"}},
        "tool_choice": msgspec.to_builtins(choice) if choice is not None else "auto",
        "tools": tools,
        "top_p": run.sampling.top_p,
        "truncation": r.truncation or "disabled",
        "usage": {
            "input_tokens": len(run.prompt),
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": len(run.prompt) + completion,
        },
        "user": r.user,
        "metadata": r.metadata or {},
    }


async def _events(run: GenerationRun, first: Any) -> AsyncGenerator[bytes, None]:
    """The streamed response: the text message item first when there is text, each call its own
    function_call item, each item done when the next begins or the answer ends."""
    choice = run.choices[0]
    seq = 0

    def event(kind: str, **data: Any) -> bytes:
        nonlocal seq
        body = {"type": kind, "sequence_number": seq, **data}
        seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json(body) + b"\n\n"

    output: list[dict] = []  # the items so far (the open one last)
    text = ""  # the open message's text
    thinking = ""  # the open reasoning item's text
    open_kind: str | None = None  # "reasoning", "message" or "function_call": the item still being written

    def close_open() -> list[bytes]:
        nonlocal open_kind, thinking
        if open_kind is None:
            return []
        i, item = len(output) - 1, output[-1]
        item["status"] = "completed"
        out = []
        if open_kind == "reasoning":
            item["content"][0]["text"] = thinking
            out.append(
                event(
                    "response.reasoning_text.done", item_id=item["id"], output_index=i, content_index=0, text=thinking
                )
            )
        elif open_kind == "message":
            part = item["content"][0]
            part["text"] = text
            out.append(
                event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            out.append(
                event("response.content_part.done", item_id=item["id"], output_index=i, content_index=0, part=part)
            )
        else:
            out.append(
                event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=i,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(event("response.output_item.done", output_index=i, item=item))
        open_kind = None
        return out

    try:
        yield event("response.created", response=response_object(run, "in_progress", []))
        yield event("response.in_progress", response=response_object(run, "in_progress", []))
        async for _, delta, _, reason in run.events(first):
            if reason == "error":
                for chunk in close_open():
                    yield chunk
                failed = response_object(run, "failed", output)
                failed["error"] = {"code": "server_error", "message": choice.error or "generation failed"}
                yield event("response.failed", response=failed)
                return
            entries: list[dict] = []
            thought = ""
            if choice.reasoning is not None:  # the reasoning apart (--reasoning-parser)
                thought, delta = choice.reasoning.feed(delta, final=reason is not None)
            if thought:
                if open_kind != "reasoning":
                    for chunk in close_open():
                        yield chunk
                    output.append(_reasoning_item("rs_" + uuid.uuid4().hex, "", "in_progress"))
                    open_kind, thinking = "reasoning", ""
                    yield event("response.output_item.added", output_index=len(output) - 1, item=output[-1])
                thinking += thought
                yield event(
                    "response.reasoning_text.delta",
                    item_id=output[-1]["id"],
                    output_index=len(output) - 1,
                    content_index=0,
                    delta=thought,
                )
            if choice.tools is not None:
                delta, entries = choice.tools.feed(delta, final=reason is not None)
            if delta:
                if open_kind != "message":
                    for chunk in close_open():
                        yield chunk
                    item = _message_item("msg_" + uuid.uuid4().hex, "", "in_progress")
                    part = item["content"][0]
                    item["content"] = []
                    output.append(item)
                    open_kind, text = "message", ""
                    i = len(output) - 1
                    yield event("response.output_item.added", output_index=i, item=item)
                    item["content"] = [part]
                    yield event(
                        "response.content_part.added",
                        item_id=item["id"],
                        output_index=i,
                        content_index=0,
                        part=dict(part),
                    )
                text += delta
                yield event(
                    "response.output_text.delta",
                    item_id=output[-1]["id"],
                    output_index=len(output) - 1,
                    content_index=0,
                    delta=delta,
                    logprobs=[],
                )
            for entry in entries:
                if "id" in entry:
                    for chunk in close_open():
                        yield chunk
                    item = _call_item(
                        "fc_" + uuid.uuid4().hex, entry["id"], entry["function"]["name"], "", "in_progress"
                    )
                    output.append(item)
                    open_kind = "function_call"
                    yield event("response.output_item.added", output_index=len(output) - 1, item=dict(item))
                elif entry["function"].get("arguments"):
                    piece = entry["function"]["arguments"]
                    output[-1]["arguments"] += piece
                    yield event(
                        "response.function_call_arguments.delta",
                        item_id=output[-1]["id"],
                        output_index=len(output) - 1,
                        delta=piece,
                    )
            if reason is not None:
                if not any(item["type"] != "reasoning" for item in output):  # an empty answer is still a message
                    for chunk in close_open():
                        yield chunk
                    item = _message_item("msg_" + uuid.uuid4().hex, "", "in_progress")
                    part = item["content"][0]
                    item["content"] = []
                    output.append(item)
                    open_kind, text = "message", ""
                    yield event("response.output_item.added", output_index=len(output) - 1, item=dict(item))
                    item["content"] = [part]
                    yield event(
                        "response.content_part.added",
                        item_id=item["id"],
                        output_index=len(output) - 1,
                        content_index=0,
                        part=dict(part),
                    )
                for chunk in close_open():
                    yield chunk
                status = _status(run)
                kind = "response.completed" if status == "completed" else "response.incomplete"
                yield event(kind, response=response_object(run, status, output))
    finally:
        await run.close()


RESPONSES = ResponsesDialect()
