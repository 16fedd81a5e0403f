"""The gateway's OpenAPI 3.1 description, served at GET /openapi.json.

The request schemas are gateway/bodies.py's structs (their bounds resolved from the serving
app's own settings: limits, model name, context length, vocabulary), so that every body this document calls invalid is refused: 400,
404 for another model, 413 when over the size limit. Rules across fields that JSON Schema cannot
state are only described, and also answered with a 400: prompt tokens + max_tokens must fit the
context; best_of >= n, and not streamed when > n (without beam search); beam search takes no
sampling knobs, penalties, logit_bias, logprobs, prompt_logprobs or output constraint; length_penalty and
early_stopping need it; at most one output constraint (response_format other than text,
structured_outputs, guided_*), whose schema, regex or grammar must compile; a completion's
max_tokens 0 needs echo or prompt_logprobs; chat's prompt_logprobs are not streamed.
An optional field given as null means its default; a field not listed is refused (400).
tests/gateway/test_api_fuzz.py fuzzes the server against this document.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, get_args

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.gateway.bodies import (
    RESPONSE_ITEMS,
    Bounds,
    ChatCompletionRequest,
    CompletionRequest,
    CountTokensRequest,
    DetokenizeRequest,
    MessagesRequest,
    ResponsesRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    request_schemas,
)
from pdserve.gateway.limits import GatewayLimits
from pdserve.protocol.messages import FinishReason

if TYPE_CHECKING:
    from pdserve.gateway.app import GatewayApp

_REF = "#/components/schemas/"
_API_KEY: list[dict[str, list[str]]] = [{}, {"bearer": []}]  # /v1/* needs the bearer key only when the server has one
_ANTHROPIC_KEY: list[dict[str, list[str]]] = [{}, {"bearer": []}, {"x_api_key": []}]  # Anthropic's clients: x-api-key


def _ref(name: str) -> dict:
    return {"$ref": _REF + name}


def _optional(schema: dict) -> dict:
    """The schema, or null (= the field's default)."""
    return {"anyOf": [schema, {"type": "null"}]}


def _object(required: list[str], **properties) -> dict:
    return {"type": "object", "required": required, "properties": properties}


def _response_schemas(model_name: str) -> dict:
    finish = {"enum": [r for r in get_args(FinishReason) if r != "error"]}  # an error is a 500
    chat_finish = {"enum": [*finish["enum"], "tool_calls"]}  # "stop" of an answer that called a tool
    num, string, integer = {"type": "number"}, {"type": "string"}, {"type": "integer"}
    top = _object(["token", "logprob", "bytes"], token=string, logprob=num, bytes={"type": "array", "items": integer})
    chat_lp = _optional(
        _object(
            ["content"],
            content={
                "type": "array",
                "items": _object(
                    ["token", "logprob", "bytes", "top_logprobs"],
                    token=string,
                    logprob=num,
                    bytes={"type": "array", "items": integer},
                    top_logprobs={"type": "array", "items": top},
                ),
            },
        )
    )
    text_lp = _optional(
        _object(
            ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
            tokens={"type": "array", "items": string},
            # (null: an echoed prompt's first token, which nothing scores)
            token_logprobs={"type": "array", "items": _optional(num)},
            top_logprobs={"type": "array", "items": _optional({"type": "object", "additionalProperties": num})},
            text_offset={"type": "array", "items": integer},
        )
    )
    # vLLM's prompt_logprobs: null first, then per prompt token {token id: {logprob, rank, decoded_token}}
    prompt_lp = {
        "type": "array",
        "items": _optional(
            {
                "type": "object",
                "additionalProperties": _object(
                    ["logprob", "rank", "decoded_token"], logprob=num, rank=integer, decoded_token=string
                ),
            }
        ),
    }
    usage = _object(
        ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
        prompt_tokens=integer,
        completion_tokens=integer,
        total_tokens=integer,
        prompt_tokens_details=_object(["cached_tokens"], cached_tokens=integer),
    )
    timings = {"type": "object", "additionalProperties": num, "description": "pdserve's per-phase timings"}

    def body(obj: str, choice: dict, *, chunk: bool = False, **more: dict) -> dict:
        extra = {"usage": usage, "pdserve_timings": timings}
        required = ["id", "object", "created", "model", "choices"] + ([] if chunk else list(extra))
        return _object(
            required,
            id=string,
            object={"const": obj},
            created=integer,
            model={"const": model_name},
            choices={"type": "array", "items": choice},
            **extra,
            **more,
        )

    index = {"type": "integer", "minimum": 0}
    call = _object(
        ["id", "type", "function"],
        id=string,
        type={"const": "function"},
        function=_object(["name", "arguments"], name=string, arguments=string),
    )
    # OpenAI's: a call's first delta has its id, type, name and arguments "", later ones argument pieces
    call_delta = _object(
        ["index"],
        index=index,
        id=string,
        type={"const": "function"},
        function=_object([], name=string, arguments=string),
    )
    return {
        "Error": _object(
            ["error"],
            error=_object(
                ["message", "type", "param", "code"],
                message=string,
                # requests / tokens: an API key's rate limit (429 rate_limit_exceeded), as OpenAI's
                type={"enum": ["invalid_request_error", "authentication_error", "server_error", "requests", "tokens"]},
                param=_optional(string),
                code=_optional(string),
            ),
        ),
        "Completion": body(
            "text_completion",
            _object(
                ["index", "text", "logprobs", "finish_reason"],
                index=index,
                text=string,
                logprobs=text_lp,
                finish_reason=finish,
                prompt_logprobs=prompt_lp,
            ),
        ),
        "ChatCompletion": body(
            "chat.completion",
            _object(
                ["index", "message", "logprobs", "finish_reason"],
                index=index,
                logprobs=chat_lp,
                finish_reason=chat_finish,
                message=_object(
                    ["role", "content"],
                    role={"const": "assistant"},
                    content=_optional(string) | {"description": "null when the answer is only tool calls"},
                    tool_calls={"type": "array", "items": call},
                ),
            ),
            prompt_logprobs=prompt_lp,
        ),
        # Streams: one JSON object per `data:` event, an error event if generation fails, then [DONE].
        "CompletionChunk": body(
            "text_completion",
            _object(
                ["index", "text", "logprobs", "finish_reason"],
                index=index,
                text=string,
                logprobs=text_lp,
                finish_reason=_optional(finish),
                prompt_logprobs=prompt_lp | {"description": "in a choice's first chunk"},
            ),
            chunk=True,
        ),
        "ChatCompletionChunk": body(
            "chat.completion.chunk",
            _object(
                ["index", "delta", "logprobs", "finish_reason"],
                index=index,
                logprobs=chat_lp,
                finish_reason=_optional(chat_finish),
                delta=_object(
                    [], role={"const": "assistant"}, content=string, tool_calls={"type": "array", "items": call_delta}
                ),
            ),
            chunk=True,
        ),
    }


def _responses_schemas(model_name: str) -> dict:
    """The Responses API's answer and stream events (gateway/responses.py)."""
    string, integer = {"type": "string"}, {"type": "integer", "minimum": 0}
    part = _object(["type", "text"], type={"const": "output_text"}, text=string)
    message = _object(
        ["type", "id", "status", "role", "content"],
        type={"const": "message"},
        id=string,
        status=string,
        role={"const": "assistant"},
        content={"type": "array", "items": part},
    )
    call = _object(
        ["type", "id", "call_id", "name", "arguments", "status"],
        type={"const": "function_call"},
        id=string,
        call_id=string,
        name=string,
        arguments=string,
        status=string,
    )
    reasoning = _object(
        ["type", "id", "summary", "content"],
        type={"const": "reasoning"},
        id=string,
        summary={"type": "array"},
        content={"type": "array", "items": _object(["type", "text"], type={"const": "reasoning_text"}, text=string)},
    )
    item = {"anyOf": [message, call, reasoning]}
    usage = _object(
        ["input_tokens", "output_tokens", "total_tokens"],
        input_tokens=integer,
        output_tokens=integer,
        total_tokens=integer,
    )
    response = _object(
        ["id", "object", "created_at", "status", "model", "output", "usage"],
        id=string,
        object={"const": "response"},
        created_at=integer,
        status={"enum": ["completed", "incomplete", "in_progress", "failed"]},
        model={"const": model_name},
        output={"type": "array", "items": item},
        usage=usage,
    )
    seq = {"sequence_number": integer}
    whole = ["response.created", "response.in_progress", "response.completed", "response.incomplete", "response.failed"]
    events = [
        _object(["type", "sequence_number", "response"], type={"enum": whole}, response=response, **seq),
        _object(
            ["type", "sequence_number", "output_index", "item"],
            type={"enum": ["response.output_item.added", "response.output_item.done"]},
            output_index=integer,
            item=item,
            **seq,
        ),
        _object(
            ["type", "sequence_number", "item_id", "output_index", "content_index", "part"],
            type={"enum": ["response.content_part.added", "response.content_part.done"]},
            item_id=string,
            output_index=integer,
            content_index=integer,
            part=part,
            **seq,
        ),
        _object(
            ["type", "sequence_number", "item_id", "output_index", "delta"],
            type={
                "enum": [
                    "response.output_text.delta",
                    "response.function_call_arguments.delta",
                    "response.reasoning_text.delta",
                ]
            },
            item_id=string,
            output_index=integer,
            delta=string,
            **seq,
        ),
        _object(
            ["type", "sequence_number", "item_id", "output_index", "text"],
            type={"enum": ["response.output_text.done", "response.reasoning_text.done"]},
            item_id=string,
            output_index=integer,
            text=string,
            **seq,
        ),
        _object(
            ["type", "sequence_number", "item_id", "output_index", "arguments"],
            type={"const": "response.function_call_arguments.done"},
            item_id=string,
            output_index=integer,
            arguments=string,
            **seq,
        ),
    ]
    return {"Response": response, "ResponseStreamEvent": {"anyOf": events}}


def _anthropic_schemas(model_name: str) -> dict:
    """Anthropic's answer, stream events and error (gateway/anthropic.py)."""
    string, integer = {"type": "string"}, {"type": "integer", "minimum": 0}
    stop = _optional({"enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]})
    usage = _object(["input_tokens", "output_tokens"], input_tokens=integer, output_tokens=integer)
    text = _object(["type", "text"], type={"const": "text"}, text=string)
    use = _object(
        ["type", "id", "name", "input"], type={"const": "tool_use"}, id=string, name=string, input={"type": "object"}
    )
    thinking = _object(["type", "thinking"], type={"const": "thinking"}, thinking=string, signature=string)
    message = _object(
        ["id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"],
        id=string,
        type={"const": "message"},
        role={"const": "assistant"},
        model={"const": model_name},
        content={"type": "array", "items": {"anyOf": [thinking, text, use]}},
        stop_reason=stop,
        stop_sequence=_optional(string),
        usage=usage,
    )
    index = {"type": "integer", "minimum": 0}
    delta = {
        "anyOf": [
            _object(["type", "text"], type={"const": "text_delta"}, text=string),
            _object(["type", "partial_json"], type={"const": "input_json_delta"}, partial_json=string),
            _object(["type", "thinking"], type={"const": "thinking_delta"}, thinking=string),
        ]
    }
    events = [
        _object(["type", "message"], type={"const": "message_start"}, message=message),
        _object(
            ["type", "index", "content_block"],
            type={"const": "content_block_start"},
            index=index,
            content_block={"anyOf": [thinking, text, use]},
        ),
        _object(["type", "index", "delta"], type={"const": "content_block_delta"}, index=index, delta=delta),
        _object(["type", "index"], type={"const": "content_block_stop"}, index=index),
        _object(
            ["type", "delta", "usage"],
            type={"const": "message_delta"},
            delta=_object(["stop_reason", "stop_sequence"], stop_reason=stop, stop_sequence=_optional(string)),
            usage=_object(["output_tokens"], output_tokens=integer),
        ),
        _object(["type"], type={"const": "message_stop"}),
    ]
    error = _object(
        ["type", "error"],
        type={"const": "error"},
        error=_object(["type", "message"], type=string, message=string) | {"additionalProperties": False},
    ) | {"additionalProperties": False}
    return {"Message": message, "MessageStreamEvent": {"anyOf": events}, "AnthropicError": error}


def _error(description: str, *, retry_after: bool = False) -> dict:
    return _error_of("Error", description, retry_after=retry_after)


def _error_of(schema: str, description: str, *, retry_after: bool = False) -> dict:
    resp = {"description": description, "content": {"application/json": {"schema": _ref(schema)}}}
    if retry_after:
        resp["headers"] = {
            "Retry-After": {"required": True, "description": "seconds", "schema": {"type": "integer", "minimum": 1}}
        }
    return resp


def _generate(
    request: str,
    result: str,
    chunk: str,
    summary: str,
    *,
    error: str = "Error",
    done: bool = True,
    security: list[dict[str, list[str]]] = _API_KEY,
) -> dict:
    """A generating endpoint: `result` as JSON, or with stream: true `chunk` events (an `error`
    event if generation fails; OpenAI's end with [DONE]); errors as `error`."""
    data = {"contentMediaType": "application/json", "contentSchema": {"anyOf": [_ref(chunk), _ref(error)]}}
    event = _object(["data"], data={"anyOf": [{"const": "[DONE]"}, data]} if done else data)

    def _error(description: str, *, retry_after: bool = False) -> dict:
        return _error_of(error, description, retry_after=retry_after)

    return {
        "post": {
            "summary": summary,
            "security": security,
            "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
            "responses": {
                "200": {
                    "description": "the result; with stream: true, server-sent events",
                    "content": {"application/json": {"schema": _ref(result)}, "text/event-stream": {"schema": event}},
                },
                "400": _error("invalid request, or max_tokens over the API key's max_tokens_per_request"),
                "401": _error("missing or wrong API key (servers started with --api-key)"),
                "404": _error("unknown model"),
                "413": _error("request body over the size limit"),
                "429": _error(
                    "the waiting queue is full, or the API key is over one of its limits (requests or "
                    "tokens per minute, requests in flight; OpenAI's x-ratelimit-* headers say which)",
                    retry_after=True,
                ),
                "500": _error("generation failed, or an internal error"),
                "503": _error("no capacity now, or the queue wait ran out", retry_after=True),
                "504": _error("the request ran past --request-timeout"),
            },
        }
    }


def _post(
    request: dict,
    result: dict,
    summary: str,
    *,
    error: str = "Error",
    security: list[dict[str, list[str]]] = _API_KEY,
) -> dict:
    """A JSON in, JSON out operation that needs no worker (the API key when the server has one)."""
    return {
        "post": {
            "summary": summary,
            "security": security,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {"schema": result}}},
                "400": _error_of(error, "invalid request"),
                "401": _error_of(error, "missing or wrong API key (servers started with --api-key)"),
                "404": _error_of(error, "unknown model"),
                "413": _error_of(error, "request body over the size limit"),
            },
        }
    }


def _get(
    summary: str, media_type: str, schema: dict, *, secured: bool = False, more_responses: dict[str, dict] | None = None
) -> dict:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "OK", "content": {media_type: {"schema": schema}}},
            **(more_responses or {}),
        },
    }
    if secured:
        op["security"] = _API_KEY
        op["responses"]["401"] = _error("missing or wrong API key")
    return {"get": op}


def openapi_document(limits: GatewayLimits, *, model_name: str, max_model_len: int, vocab_size: int) -> dict:
    bounds = Bounds.of(limits, model_name=model_name, max_model_len=max_model_len, vocab_size=vocab_size)
    health = {"type": "object", "required": ["status"], "properties": {"status": {"enum": ["ok", "unavailable"]}}}
    model = _object(
        ["id", "object", "created", "owned_by", "max_model_len"],
        id={"const": model_name},
        object={"const": "model"},
        created={"type": "integer"},
        owned_by={"type": "string"},
        max_model_len={"const": max_model_len},
    )
    return {
        "openapi": "3.1.0",
        "info": {"title": "pdserve", "version": "1", "description": "OpenAI-compatible completions API"},
        "paths": {
            "/v1/completions": _generate("CompletionRequest", "Completion", "CompletionChunk", "text completion"),
            "/v1/chat/completions": _generate(
                "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk", "chat completion"
            ),
            "/tokenize": _post(
                {"anyOf": [_ref("TokenizeCompletionRequest"), _ref("TokenizeChatRequest")]},
                _object(
                    ["count", "max_model_len", "tokens", "token_strs"],
                    count={"type": "integer", "minimum": 0},
                    max_model_len={"const": max_model_len},
                    tokens={"type": "array", "items": {"type": "integer", "minimum": 0}},
                    token_strs=_optional({"type": "array", "items": {"type": "string"}}),
                ),
                "text, or chat messages through the chat template, to token ids (vLLM's)",
            ),
            "/detokenize": _post(
                _ref("DetokenizeRequest"),
                _object(["prompt"], prompt={"type": "string"}),
                "token ids to text (vLLM's)",
            ),
            "/v1/responses": _generate(
                "ResponsesRequest",
                "Response",
                "ResponseStreamEvent",
                "OpenAI's Responses API, stateless (nothing stored; previous_response_id is a 400)",
                done=False,
            ),
            "/v1/messages": _generate(
                "MessagesRequest",
                "Message",
                "MessageStreamEvent",
                "Anthropic's Messages API",
                error="AnthropicError",
                done=False,
                security=_ANTHROPIC_KEY,
            ),
            "/v1/messages/count_tokens": _post(
                _ref("CountTokensRequest"),
                _object(["input_tokens"], input_tokens={"type": "integer", "minimum": 0}),
                "the prompt's tokens as /v1/messages would send them (Anthropic's)",
                error="AnthropicError",
                security=_ANTHROPIC_KEY,
            ),
            "/v1/models": _get(
                "the served model",
                "application/json",
                _object(
                    ["object", "data"],
                    object={"const": "list"},
                    data={"type": "array", "minItems": 1, "maxItems": 1, "items": model},
                ),
                secured=True,
            ),
            "/health": _get(
                "whether each pool has a live worker",
                "application/json",
                health,
                more_responses={
                    "503": {
                        "description": "a pool has no live worker",
                        "content": {"application/json": {"schema": health}},
                    }
                },
            ),
            "/metrics": _get("Prometheus metrics", "text/plain", {"type": "string"}),
            "/openapi.json": _get("this document", "application/json", {"type": "object"}),
        },
        "components": {
            "schemas": {
                **request_schemas(
                    [
                        CompletionRequest,
                        ChatCompletionRequest,
                        TokenizeCompletionRequest,
                        TokenizeChatRequest,
                        DetokenizeRequest,
                        ResponsesRequest,
                        *RESPONSE_ITEMS.values(),
                        MessagesRequest,
                        CountTokensRequest,
                    ],
                    bounds,
                ),
                **_responses_schemas(model_name),
                **_anthropic_schemas(model_name),
                **_response_schemas(model_name),
            },
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the server's --api-key; needed on /v1/* when set",
                },
                "x_api_key": {"type": "apiKey", "in": "header", "name": "x-api-key", "description": "the same keys"},
            },
        },
    }


def openapi_endpoint(gw: GatewayApp):
    """The GET /openapi.json handler for this app."""
    doc = openapi_document(
        gw.limits, model_name=gw.model_name, max_model_len=gw.max_model_len, vocab_size=gw.vocab_size
    )

    async def openapi(_: Request) -> Response:
        return JSONResponse(doc)

    return openapi
