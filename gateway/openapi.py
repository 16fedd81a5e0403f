"""The gateway's OpenAPI 3.1 description, served at GET /openapi.json.

The request schemas are gateway/bodies.py's structs (their bounds resolved from the serving
app's own settings: limits, model name, context length, vocabulary), so that every body this document calls invalid is refused: 400,
404 for another model, 413 when over the size limit. Rules across fields that JSON Schema cannot
state are only described, and also answered with a 400: prompt tokens + max_tokens must fit the
context; best_of >= n, and not streamed when > n (without beam search); beam search takes no
sampling knobs, penalties, logit_bias, logprobs or output constraint; length_penalty and
early_stopping need it; at most one output constraint (response_format other than text,
structured_outputs, guided_*), whose schema, regex or grammar must compile.
An optional field given as null means its default; a field not listed is refused (400).
tests/gateway/test_api_fuzz.py fuzzes the server against this document.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, get_args

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.gateway.bodies import (
    Bounds,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
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
            token_logprobs={"type": "array", "items": num},
            top_logprobs={"type": "array", "items": {"type": "object", "additionalProperties": num}},
            text_offset={"type": "array", "items": integer},
        )
    )
    usage = _object(
        ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
        prompt_tokens=integer,
        completion_tokens=integer,
        total_tokens=integer,
        prompt_tokens_details=_object(["cached_tokens"], cached_tokens=integer),
    )
    timings = {"type": "object", "additionalProperties": num, "description": "pdserve's per-phase timings"}

    def body(obj: str, choice: dict, *, chunk: bool = False) -> dict:
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


def _error(description: str, *, retry_after: bool = False) -> dict:
    resp = {"description": description, "content": {"application/json": {"schema": _ref("Error")}}}
    if retry_after:
        resp["headers"] = {
            "Retry-After": {"required": True, "description": "seconds", "schema": {"type": "integer", "minimum": 1}}
        }
    return resp


def _generate(request: str, result: str, chunk: str, summary: str) -> dict:
    event = _object(
        ["data"],
        data={
            "anyOf": [
                {"const": "[DONE]"},
                {"contentMediaType": "application/json", "contentSchema": {"anyOf": [_ref(chunk), _ref("Error")]}},
            ]
        },
    )
    return {
        "post": {
            "summary": summary,
            "security": _API_KEY,
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


def _post(request: dict, result: dict, summary: str) -> dict:
    """A JSON in, JSON out operation that needs no worker (the API key when the server has one)."""
    return {
        "post": {
            "summary": summary,
            "security": _API_KEY,
            "requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {"schema": result}}},
                "400": _error("invalid request"),
                "401": _error("missing or wrong API key (servers started with --api-key)"),
                "404": _error("unknown model"),
                "413": _error("request body over the size limit"),
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
                    ],
                    bounds,
                ),
                **_response_schemas(model_name),
            },
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "the server's --api-key; needed on /v1/* when set",
                }
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
