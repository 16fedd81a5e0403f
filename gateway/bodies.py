"""Every request body the gateway takes, declared once: a msgspec struct per endpoint, its fields'
types and constraints in their annotations. From these come the parsing (`decode`: types,
ranges, unknown fields, a 400 naming the field's path), GET /openapi.json's request schemas
(gateway/openapi.py, `request_schemas`), and, through gateway/schemas.py, the one internal
request every endpoint maps onto. A new field is one line here (plus, for a sampling parameter,
its line in protocol/sampling.py's SamplingParams, which the sampling fields are passed to by name).

Bounds that depend on the server (the gateway's limits, the context length, the vocabulary, the
model's name) are written as names (`limit(maximum="max_n")`) and resolved per app: checked by
`decode`, published by the OpenAPI document. What msgspec's types cannot state (a prompt that is
text or token ids, tools, output constraints) is an `Any` field whose JSON Schema is given next to
it and whose checks are gateway/schemas.py's, gateway/constraints.py's and gateway/tools/'s.
An optional field given as null means its default.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, TypeVar, Union

import msgspec
import msgspec.inspect as mi
from msgspec import Meta

from pdserve.gateway.errors import invalid
from pdserve.gateway.limits import GatewayLimits

_INT64 = 2**63
REF = "#/components/schemas/{name}"  # where the OpenAPI description keeps the structs' schemas
T = TypeVar("T")


def limit(**bounds: str) -> Meta:
    """JSON Schema bounds named by a server setting (`Bounds`' fields): checked and published."""
    return Meta(extra_json_schema={"x-limits": bounds})


def schema(description: str | None = None, **json_schema: Any) -> Meta:
    """A field's JSON Schema given by hand (an `Any` field msgspec's types cannot state)."""
    if description is not None:
        json_schema["description"] = description
    return Meta(extra_json_schema=json_schema)


def doc(text: str) -> Meta:
    return Meta(description=text)


class Bounds(NamedTuple):
    """The server's values for the bounds' names."""

    max_n: int
    max_logprobs: int
    max_stop: int
    max_stop_len: int
    max_new_tokens: int  # the context less one prompt token
    max_token_id: int  # the vocabulary's last id
    model_name: str

    @classmethod
    def of(cls, limits: GatewayLimits, *, model_name: str, max_model_len: int, vocab_size: int) -> Bounds:
        return cls(
            limits.max_n,
            limits.max_logprobs,
            limits.max_stop,
            limits.max_stop_len,
            max(1, max_model_len - 1),
            vocab_size - 1,
            model_name,
        )


# --- field types shared by the bodies -----------------------------------------------------------
Int64 = Annotated[int, Meta(ge=-_INT64, le=_INT64 - 1)]  # what msgpack carries to the workers
Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1, le=_INT64 - 1)]  # more overflowed torch.tensor in a worker's sampler
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
NewTokens = Annotated[int, Meta(ge=1), limit(maximum="max_new_tokens")]
TopLogprobs = Annotated[int, Meta(ge=0), limit(maximum="max_logprobs")]
StopString = Annotated[str, Meta(min_length=1), limit(maxLength="max_stop_len")]
Stop = Union[StopString, Annotated[list[StopString], limit(maxItems="max_stop")], None]
ServedModel = Annotated[Union[str, None], schema("404 model_not_found for any other name", **{"x-served-model": True})]
_NONEMPTY = {"type": "string", "minLength": 1}
_TOKENS = {
    "type": "array",
    "minItems": 1,
    "items": {"type": "integer", "minimum": 0, "x-limits": {"maximum": "max_token_id"}},
}


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Sampling parameters passed to protocol/sampling.py's SamplingParams by name (null: its
    default). Every generating endpoint takes these."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=10.0)] | None = None
    min_tokens: Annotated[int, Meta(ge=0)] | None = None
    ignore_eos: bool | None = None

    SAMPLING: ClassVar[tuple[str, ...]] = (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
    )


# --- output constraints and tools (checked by gateway/constraints.py and gateway/tools/) ---------
_JSON_SCHEMA = {"type": "object", "description": "a JSON Schema; invalid ones are a 400"}
_CHOICE = {"type": "array", "minItems": 1, "items": _NONEMPTY}
_JSON_SCHEMA_FORMAT = {
    "type": "object",
    "required": ["name", "schema"],
    "properties": {
        "name": {"type": "string"},
        "schema": _JSON_SCHEMA,
        "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
        "description": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "additionalProperties": False,
}
_RESPONSE_FORMAT = {
    "anyOf": [
        {
            "type": "object",
            "required": ["type"],
            "properties": {"type": {"enum": ["text", "json_object"]}},
            "additionalProperties": False,
        },
        {
            "type": "object",
            "required": ["type", "json_schema"],
            "properties": {"type": {"const": "json_schema"}, "json_schema": _JSON_SCHEMA_FORMAT},
            "additionalProperties": False,
        },
        {"type": "null"},
    ]
}
_STRUCTURED = {
    "anyOf": [
        {
            "type": "object",
            "properties": {
                "json": {"anyOf": [_JSON_SCHEMA, _NONEMPTY, {"type": "null"}]},
                "regex": {"anyOf": [_NONEMPTY, {"type": "null"}]},
                "choice": {"anyOf": [_CHOICE, {"type": "null"}]},
                "grammar": {"anyOf": [_NONEMPTY | {"description": "Lark, or GBNF (with ::=)"}, {"type": "null"}]},
                "json_object": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
            },
            "additionalProperties": False,
            "minProperties": 1,
            "description": "vLLM's: exactly one constraint",
        },
        {"type": "null"},
    ]
}


class ConstraintFields(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    """Output constraints (gateway/constraints.py): at most one; and the sampling fields."""

    response_format: Annotated[
        Any, schema("JSON mode or a JSON schema the output follows (compact JSON)", **_RESPONSE_FORMAT)
    ] = None
    structured_outputs: Annotated[Any, schema(**_STRUCTURED)] = None
    guided_json: Annotated[Any, schema("vLLM's older name", anyOf=[_JSON_SCHEMA, _NONEMPTY, {"type": "null"}])] = None
    guided_regex: Annotated[Any, schema("the whole output matches it", anyOf=[_NONEMPTY, {"type": "null"}])] = None
    guided_choice: Annotated[Any, schema(anyOf=[_CHOICE, {"type": "null"}])] = None
    guided_grammar: Annotated[Any, schema(anyOf=[_NONEMPTY, {"type": "null"}])] = None


FUNCTION_NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}
_FUNCTION = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": FUNCTION_NAME,
        "description": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "parameters": {"type": "object", "description": "a JSON schema of an object (type: object)"},
        "strict": {"anyOf": [{"type": "boolean"}, {"type": "null"}]},
    },
    "additionalProperties": False,
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {"type": {"const": "function"}, "function": _FUNCTION},
    "additionalProperties": False,
}
_NAMED_CHOICE = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"const": "function"},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": {"type": "string"}},
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
}


# --- /v1/completions and /v1/chat/completions -------------------------------------------------
class OpenAIFields(ConstraintFields, kw_only=True, forbid_unknown_fields=True):
    """What both OpenAI generating endpoints take besides their prompt."""

    model: ServedModel = None
    n: Annotated[int, Meta(ge=1), limit(maximum="max_n")] | None = None
    stream: bool | None = None
    stream_options: Annotated[StreamOptions | None, doc("only with stream: true")] = None
    stop: Stop = None
    stop_token_ids: list[Int64] | None = None
    logit_bias: Annotated[
        dict[Annotated[str, Meta(pattern="^[0-9]{1,18}$")], Annotated[float, Meta(ge=-100.0, le=100.0)]] | None,
        doc("token id (below the vocabulary size) -> bias added to its logit"),
    ] = None
    user: str | None = None  # the caller's end-user id, kept by nobody
    best_of: Annotated[
        Annotated[int, Meta(ge=1), limit(maximum="max_n")] | None,
        doc(">= n: sequences generated, the n with the highest cumulative logprob return"),
    ] = None
    use_beam_search: Annotated[
        bool | None, doc("beam search of width best_of (or n); the n best beams return (vLLM's extra parameter)")
    ] = None
    length_penalty: Annotated[
        Annotated[float, Meta(ge=-10.0, le=10.0)] | None,
        doc("beam score = sum logprob / length ** length_penalty; beam search only"),
    ] = None
    early_stopping: Annotated[
        Union[bool, Literal["never"], None], doc("Hugging Face's beam stopping rule; beam search only")
    ] = None
    priority: Annotated[
        Int64 | None,
        doc(
            "admission order while requests wait for a worker: lower first, arrival order within one (vLLM's); "
            "null: the API key's default (0 without one)"
        ),
    ] = None
    prompt_logprobs: Annotated[
        TopLogprobs | None,
        doc(
            "vLLM's: each prompt token's logprob, rank and this many top alternatives, as `prompt_logprobs` (a list "
            "per prompt token, the first null, each other a map token id -> {logprob, rank, decoded_token}; per "
            "choice in completions, beside the choices in chat); the prompt is computed whole (no prefix-cache reuse)"
        ),
    ] = None

    NEEDS_TRUE: ClassVar[tuple[tuple[str, str], ...]] = (("stream_options", "stream"),)


class CompletionRequest(OpenAIFields, kw_only=True, forbid_unknown_fields=True):
    # One prompt per request: a batch of one is unwrapped.
    prompt: Annotated[
        Any,
        schema(
            "text, or token ids below the vocabulary size",
            anyOf=[
                _NONEMPTY,
                _TOKENS,
                {"type": "array", "minItems": 1, "maxItems": 1, "items": _NONEMPTY},
                {"type": "array", "minItems": 1, "maxItems": 1, "items": _TOKENS},
            ],
        ),
    ]
    max_tokens: Annotated[
        Annotated[int, Meta(ge=0), limit(maximum="max_new_tokens")] | None,
        Meta(extra_json_schema={"default": 16}),
        doc("0: nothing generated, the prompt only scored (needs echo or prompt_logprobs)"),
    ] = None
    logprobs: TopLogprobs | None = None
    echo: Annotated[
        bool | None,
        doc(
            "the prompt first: its text before the generated text, and with logprobs its tokens before the "
            "generated ones (the first token's logprob and top_logprobs null); the prompt is computed whole"
        ),
    ] = None
    suffix: Annotated[Literal[""] | None, doc("not supported")] = None


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class PastFunction(msgspec.Struct):
    name: str
    arguments: Annotated[str, doc("JSON text")]


class PastCall(msgspec.Struct):
    function: PastFunction
    id: str | None = None
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: Annotated[list[PastCall] | None, doc("assistant messages only")] = None
    tool_call_id: Annotated[str | None, doc("tool messages (role: tool) only, and required there")] = None
    name: str | None = None


class ChatCompletionRequest(OpenAIFields, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: NewTokens | None = None
    # The older name: the context bound applies only when max_completion_tokens is null.
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[TopLogprobs | None, doc("only with logprobs: true")] = None
    tools: Annotated[Any, schema(anyOf=[{"type": "array", "items": _TOOL}, {"type": "null"}])] = None
    tool_choice: Annotated[
        Any,
        schema(
            "auto (the default with tools): calls read from the output; required or a named function: the call "
            "is forced by a grammar (of --tool-call-parser's format, or a JSON list of calls without one)",
            anyOf=[{"enum": ["none", "auto", "required", None]}, _NAMED_CHOICE],
        ),
    ] = None
    parallel_tool_calls: bool | None = None

    NEEDS_TRUE: ClassVar[tuple[tuple[str, str], ...]] = (("stream_options", "stream"), ("top_logprobs", "logprobs"))


# --- /tokenize and /detokenize (vLLM's) ---------------------------------------------------------
class TokenizeCompletionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    prompt: str
    model: ServedModel = None
    add_special_tokens: Annotated[bool | None, doc("the tokenizer's special tokens around the text (default true)")] = (
        None
    )
    return_token_strs: Annotated[bool | None, doc("each token's text too")] = None


class TokenizeChatRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    model: ServedModel = None
    add_generation_prompt: Annotated[bool | None, doc("end with the assistant's turn opening (default true)")] = None
    continue_final_message: Annotated[
        bool | None, doc("leave the last message open, to be continued (default false)")
    ] = None
    add_special_tokens: Annotated[bool | None, doc("special tokens besides the template's (default false)")] = None
    return_token_strs: bool | None = None
    tools: Annotated[Any, schema(anyOf=[{"type": "array", "items": _TOOL}, {"type": "null"}])] = None


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    tokens: list[Annotated[int, Meta(ge=0), limit(maximum="max_token_id")]]
    model: ServedModel = None


# --- Anthropic's /v1/messages and /v1/messages/count_tokens -------------------------------------
class CacheControl(msgspec.Struct):
    type: str = "ephemeral"  # (prompt caching is the prefix cache's, automatic: accepted, not needed)
    ttl: str | None = None


class AnthropicText(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    text: str
    cache_control: CacheControl | None = None
    citations: Annotated[list[Any] | None, doc("accepted; not produced")] = None


class AnthropicTextPart(msgspec.Struct, kw_only=True):
    """A text block where only text blocks go (system, a tool result's content): its type stated."""

    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: Annotated[list[Any] | None, doc("accepted; not produced")] = None


class AnthropicToolUse(msgspec.Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class AnthropicToolResult(msgspec.Struct, tag_field="type", tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[AnthropicTextPart] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


AnthropicBlock = Union[AnthropicText, AnthropicToolUse, AnthropicToolResult]


class AnthropicMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: Annotated[str | list[AnthropicBlock], doc("text, or text, tool_use and tool_result blocks")]


class AnthropicTool(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(pattern="^[a-zA-Z0-9_-]{1,64}$")]
    input_schema: Annotated[dict[str, Any], doc("a JSON schema of the input object (type: object)")]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None


class AnthropicToolChoice(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Annotated[
        Literal["auto", "any", "tool", "none"],
        doc("auto: calls read from the output (needs --tool-call-parser); any or tool (with name): forced"),
    ]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicOutputFormat(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["json_schema"]
    schema: Annotated[dict[str, Any], doc("a JSON Schema the answer follows; invalid ones are a 400")]


class AnthropicOutputConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: AnthropicOutputFormat | None = None
    effort: Annotated[
        Literal["low", "medium", "high", "xhigh", "max"] | None, doc("accepted; no effect (no reasoning output)")
    ] = None


class AnthropicThinking(msgspec.Struct, forbid_unknown_fields=True):
    type: Annotated[
        Literal["disabled", "enabled", "adaptive"],
        doc("accepted: thinking blocks come from the model's reasoning under --reasoning-parser"),
    ]
    budget_tokens: int | None = None


class AnthropicMetadata(msgspec.Struct):
    user_id: str | None = None  # kept by nobody


class MessagesRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: ServedModel
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    max_tokens: NewTokens
    system: str | list[AnthropicTextPart] | None = None
    stop_sequences: Annotated[list[StopString], limit(maxItems="max_stop")] | None = None
    stream: bool | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=100.0)] | None = None
    top_p: TopP | None = None
    top_k: Annotated[int, Meta(ge=0, le=_INT64 - 1)] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: AnthropicMetadata | None = None
    output_config: AnthropicOutputConfig | None = None
    thinking: AnthropicThinking | None = None
    cache_control: Annotated[CacheControl | None, doc("accepted: the prefix cache reuses prompts by itself")] = None


class CountTokensRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: ServedModel
    messages: Annotated[list[AnthropicMessage], Meta(min_length=1)]
    system: str | list[AnthropicTextPart] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


# --- OpenAI's /v1/responses (stateless) -----------------------------------------------------------
class ResponseInputText(msgspec.Struct, kw_only=True):
    type: Literal["input_text", "output_text"]  # (an earlier answer's text comes back as output_text)
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ResponseInputMessage(msgspec.Struct, kw_only=True):
    """A turn: `type` may be left out (the SDK's easy form)."""

    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ResponseInputText]
    type: Literal["message"] | None = None
    id: str | None = None
    status: str | None = None


class ResponseFunctionCall(msgspec.Struct, kw_only=True):
    """An earlier answer's call, sent back with its output."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: Annotated[str, doc("JSON text")]
    id: str | None = None
    status: str | None = None


class ResponseFunctionCallOutput(msgspec.Struct, kw_only=True):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ResponseInputText]
    id: str | None = None
    status: str | None = None


RESPONSE_ITEMS = {
    "message": ResponseInputMessage,
    "function_call": ResponseFunctionCall,
    "function_call_output": ResponseFunctionCallOutput,
}
_RESPONSE_INPUT = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"anyOf": [{"$ref": REF.format(name=t.__name__)} for t in RESPONSE_ITEMS.values()]}},
    ]
}


class ResponseFunctionTool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Annotated[Literal["function"], doc("function tools only")]
    name: Annotated[str, Meta(pattern="^[a-zA-Z0-9_-]{1,64}$")]
    parameters: Annotated[dict[str, Any] | None, doc("a JSON schema of an object (type: object)")] = None
    description: str | None = None
    strict: bool | None = None


class ResponseNamedTool(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    name: str


class FormatText(msgspec.Struct, tag_field="type", tag="text", forbid_unknown_fields=True):
    pass


class FormatJsonObject(msgspec.Struct, tag_field="type", tag="json_object", forbid_unknown_fields=True):
    pass


class FormatJsonSchema(msgspec.Struct, tag_field="type", tag="json_schema", kw_only=True, forbid_unknown_fields=True):
    name: str
    schema: Annotated[dict[str, Any], doc("a JSON Schema; invalid ones are a 400")]
    description: str | None = None
    strict: bool | None = None


class ResponseText(msgspec.Struct, forbid_unknown_fields=True):
    format: Union[FormatText, FormatJsonObject, FormatJsonSchema, None] = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponseReasoning(msgspec.Struct):
    effort: Annotated[str | None, doc("accepted; no effect (no reasoning output)")] = None
    summary: str | None = None


class ResponsesRequest(SamplingFields, kw_only=True, forbid_unknown_fields=True):
    model: ServedModel = None
    input: Annotated[
        Any,
        schema(
            "text, or items: messages (role and content), function_call and function_call_output", **_RESPONSE_INPUT
        ),
    ]
    instructions: Annotated[str | None, doc("a system message before the input")] = None
    max_output_tokens: NewTokens | None = None
    stream: bool | None = None
    tools: list[ResponseFunctionTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], ResponseNamedTool, None] = None
    parallel_tool_calls: bool | None = None
    text: ResponseText | None = None
    store: Annotated[bool | None, doc("accepted; nothing is stored (stateless)")] = None
    previous_response_id: Annotated[
        str | None, doc("not supported: nothing is stored; send the whole conversation as input")
    ] = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: ResponseReasoning | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    stop: Annotated[Stop, doc("pdserve's: stop strings, as chat's")] = None


# --- parsing --------------------------------------------------------------------------------------
_PATH = re.compile(r" - at `(?:key` in `)?\$\.?([^`]*)`$")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


_JSON_NAMES = {"bool": "boolean", "int": "integer", "float": "number", "str": "string", "array": "list"}
_EXPECTED = re.compile(r"Expected `([^`]*)`, got `([^`]*)`")


def _words(text: str) -> str:
    """msgspec's "Expected `bool | null`, got `str`" in JSON's words."""
    m = _EXPECTED.match(text)
    if m is None:
        return text[:1].lower() + text[1:]

    def names(types: str) -> str:
        return " or ".join(_JSON_NAMES.get(t.strip(), t.strip()) for t in types.split("|"))

    def a(words: str) -> str:
        return ("an " if words[0] in "aeiou" else "a ") + words

    return f"must be {a(names(m.group(1)))}, got {a(names(m.group(2)))}" + text[m.end() :]


def _param(path: str) -> str:
    """The top-level field of a msgspec error path (`messages[0].role` -> `messages`)."""
    return re.split(r"[.\[]", path, maxsplit=1)[0]


def decode(body: Any, type_: type[T], bounds: Bounds) -> T:
    """The body as `type_`, its server-dependent bounds checked; a 400 naming the field otherwise."""
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    try:
        out = msgspec.convert(body, type_)
    except msgspec.ValidationError as e:
        text = str(e)
        m = _PATH.search(text)
        path = m.group(1) if m else ""
        field = _UNKNOWN.search(text) or _MISSING.search(text)
        if not path and field:
            path = field.group(1)
            if _UNKNOWN.search(text):
                raise invalid(f"unrecognized request argument '{path}'", path) from None
        where = f"'{path}'" if path else "request body"
        raise invalid(f"{where}: {_words(_PATH.sub('', text))}", _param(path) or None) from None
    for name, info, value in _limited_fields(out, type_):
        _check_limits(value, info, bounds, name, name)
    for field_name, flag in getattr(type_, "NEEDS_TRUE", ()):
        if getattr(out, field_name) is not None and getattr(out, flag) is not True:
            raise invalid(f"'{field_name}' is only allowed when '{flag}' is true", field_name)
    return out


_LIMITED: dict[type, list[tuple[str, Any]]] = {}


def _limited_fields(obj: Any, type_: type) -> Iterator[tuple[str, Any, Any]]:
    """(name, type info, value) of each top-level field with a server-dependent bound inside."""
    fields = _LIMITED.get(type_)
    if fields is None:
        info = mi.type_info(type_)
        assert isinstance(info, mi.StructType)
        fields = _LIMITED[type_] = [(f.name, f.type) for f in info.fields if _has_limits(f.type)]
    for name, t in fields:
        value = getattr(obj, name)
        if value is not None:
            yield name, t, value


def _has_limits(t: Any) -> bool:
    if isinstance(t, mi.Metadata):
        return bool((t.extra_json_schema or {}).get("x-limits")) or _has_limits(t.type)
    if isinstance(t, mi.UnionType):
        return any(_has_limits(x) for x in t.types)
    if isinstance(t, (mi.ListType, mi.DictType)):
        return _has_limits(t.item_type if isinstance(t, mi.ListType) else t.value_type)
    return False


def _check_limits(value: Any, t: Any, bounds: Bounds, path: str, param: str) -> None:
    if isinstance(t, mi.UnionType):  # the member the value decoded as
        for member in t.types:
            base = member.type if isinstance(member, mi.Metadata) else member
            if (
                (isinstance(base, mi.StrType) and isinstance(value, str))
                or (isinstance(base, mi.IntType) and isinstance(value, int))
                or (isinstance(base, mi.ListType) and isinstance(value, list))
            ):
                _check_limits(value, member, bounds, path, param)
                return
        return
    if isinstance(t, mi.Metadata):
        for key, name in ((t.extra_json_schema or {}).get("x-limits") or {}).items():
            bound = getattr(bounds, name)
            size = len(value) if key in ("maxItems", "maxLength") else value
            if size > bound:
                what = {"maxItems": "items", "maxLength": "characters"}.get(key)
                said = f"at most {bound} {what}" if what else f"<= {bound}"
                raise invalid(f"'{path}' must be {said}", param)
        _check_limits(value, t.type, bounds, path, param)
    elif isinstance(t, mi.ListType):
        for i, item in enumerate(value):
            _check_limits(item, t.item_type, bounds, f"{path}[{i}]", param)


# --- the OpenAPI description ----------------------------------------------------------------------


def request_schemas(types: list[type], bounds: Bounds) -> dict[str, dict]:
    """JSON Schemas of `types` (components named by class), their named bounds resolved, each
    struct's NEEDS_TRUE rules stated."""
    _, components = msgspec.json.schema_components(types, ref_template=REF)
    out = {name: _resolve(s, bounds) for name, s in components.items()}
    for t in types:
        rules = getattr(t, "NEEDS_TRUE", ())
        if rules:
            out[t.__name__] |= _needs_true(rules)
    return out


def _resolve(node: Any, bounds: Bounds) -> Any:
    if isinstance(node, list):
        return [_resolve(x, bounds) for x in node]
    if not isinstance(node, dict):
        return node
    if node.get("x-served-model"):
        return {"enum": [bounds.model_name, None], "description": node.get("description", "")}
    out = {
        k: _resolve(v, bounds)
        for k, v in node.items()
        if k not in ("x-limits", "title") and not (k == "default" and v is None)  # null: the default
    }
    for key, name in (node.get("x-limits") or {}).items():
        out[key] = getattr(bounds, name)
    return out


def _needs_true(rules: tuple[tuple[str, str], ...]) -> dict:
    """For each (field, flag): `field`, when not null, needs `flag`: true.

    Spelled as one anyOf over every combination of (field is null | flag is true): schemathesis's
    coverage phase finds valid bodies for that, but hardly any for an allOf of several anyOfs."""
    branches: list[dict[str, Any]] = [{"required": [], "properties": {}}]
    for field, flag in rules:
        branches = [
            {"required": b["required"] + req, "properties": {**b["properties"], **props}}
            for b in branches
            for req, props in (([], {field: {"type": "null"}}), ([flag], {flag: {"const": True}}))
        ]
    return {"anyOf": branches}
