"""The one internal request (`ParsedRequest`) every endpoint maps onto, and the OpenAI bodies'
mapping: `parse_request` decodes a body as its endpoint's struct (gateway/bodies.py: types,
ranges and unknown fields, each failure a 400 naming its parameter) and then checks what spans
fields (prompt forms, group and beam rules, output constraints, tools).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from pdserve.gateway.bodies import (
    Bounds,
    ChatCompletionRequest,
    CompletionRequest,
    ConstraintFields,
    OpenAIFields,
    SamplingFields,
    decode,
)
from pdserve.gateway.constraints import parse_constraint
from pdserve.gateway.errors import invalid
from pdserve.gateway.tools.constraint import tool_constraint
from pdserve.gateway.tools.parser import ToolParser
from pdserve.gateway.tools.request import ToolRequest, parse_tools, tool_message
from pdserve.protocol.sampling import SamplingParams, StructuredOutput

RequestKind = Literal["completion", "chat"]  # the response shapes (gateway/formats.py); other APIs map onto chat
_DEFAULTS = SamplingParams()


@dataclass
class ParsedRequest:
    kind: RequestKind
    model: str | None
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict] | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    # SamplingParams' keyword arguments the body gave (gateway/bodies.py SamplingFields: temperature, ...)
    sampling: dict[str, Any] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # top-N alternatives; None = no logprobs
    echo: bool = False  # completions: the prompt first (its text; with logprobs, its tokens' logprobs)
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob, rank and top-K; None = none
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, bias) added to logits
    # several sequences from one prompt (engine/sequence_group.py)
    best_of: int | None = None  # sequences generated; the n with the highest cumulative logprob return
    use_beam_search: bool = False  # vLLM's extra parameter: beam width best_of (or n)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    priority: int | None = None  # vLLM's: lower is admitted first; None = the API key's default
    structured: StructuredOutput | None = None  # response_format / structured_outputs / guided_* (constraints.py)
    tools: ToolRequest | None = None  # chat's tools and tool_choice (gateway/tools/)
    splits_reasoning: bool = False  # its reasoning goes apart under --reasoning-parser (chat's reasoning_content)
    source: Any = None  # the endpoint's own body, where its answer repeats it (Responses)
    constraint_check_s: float = 0.0  # spent compiling its constraint and tool schemas to check them

    @property
    def temperature(self) -> float:
        return self.sampling.get("temperature", _DEFAULTS.temperature)

    @property
    def seed(self) -> int | None:
        return self.sampling.get("seed")

    @property
    def constraint_kind(self) -> str | None:
        """What constrains its output, for metrics: a StructuredOutput kind, or tool_call."""
        if self.structured is None:
            return None
        return "tool_call" if self.tools is not None and self.tools.forced else self.structured.kind

    @property
    def prompt_top(self) -> int | None:
        """The top alternatives each prompt token is scored with (SamplingParams.prompt_logprobs):
        enough for echo's logprobs and for prompt_logprobs; None when neither asks."""
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(asked) if asked else None

    @property
    def scores_only(self) -> bool:
        """max_tokens 0: the prompt is scored and nothing generated (its one token, computed to
        finish the prefill, is dropped at the gateway)."""
        return self.max_tokens == 0

    @property
    def num_seqs(self) -> int:
        """Sequences generated: best_of (the beam width with beam search), else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_group(self) -> bool:
        """One backend request whose choices come back by index (else n independent requests)."""
        return self.n > 1 or self.use_beam_search or (self.best_of or 1) > 1


# what beam search leaves alone: it is deterministic and scores raw logprobs
BEAM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "temperature": (0, 0.0, None),
    "top_p": (1, 1.0, None),
    "top_k": (-1, 0, None),
    "min_p": (0, 0.0, None),
    "seed": (None,),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "logit_bias": (None, {}),
}


def _is_int(value: Any) -> bool:
    """A JSON integer: 5.0 counts, a bool does not."""
    return (isinstance(value, float) and value.is_integer()) or (isinstance(value, int) and not isinstance(value, bool))


def _token_ids(value: Any) -> list[int] | None:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        return None
    return [int(t) for t in value]


def _message_text(content: Any, idx: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"messages[{idx}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)
    if content is None:
        return ""
    raise invalid(f"messages[{idx}].content must be a string or a list of text parts", "messages")


def _logit_bias(value: dict[str, float] | None) -> list[tuple[int, float]]:
    """{"token id": bias} (checked by the body's type) -> sorted (id, bias) pairs; ids are checked
    against the vocabulary by the caller."""
    return sorted((int(key), float(bias)) for key, bias in (value or {}).items())


def parse_request(body: Any, kind: RequestKind, bounds: Bounds, tool_parser: ToolParser | None = None) -> ParsedRequest:
    """An OpenAI body. `tool_parser`: --tool-call-parser's, which reads tool calls and writes the
    grammar of a forced one (without one, a forced call is a JSON list of calls: gateway/tools/)."""
    if kind == "completion":
        comp = decode(body, CompletionRequest, bounds)
        req = openai_request(comp, kind)
        prompt = comp.prompt
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise invalid("'prompt' must not be empty", "prompt")
            req.prompt_text = prompt
        elif isinstance(prompt, list) and not prompt:
            raise invalid("'prompt' must not be empty", "prompt")
        elif (ids := _token_ids(prompt)) is not None:
            req.prompt_ids = ids
        else:
            raise invalid("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
        req.logprobs = comp.logprobs
        req.echo = bool(comp.echo)
        req.max_tokens = 16 if comp.max_tokens is None else comp.max_tokens
        if req.scores_only and not req.echo and req.prompt_logprobs is None:
            raise invalid("'max_tokens' 0 generates nothing: it needs 'echo' or 'prompt_logprobs'", "max_tokens")
        finish_openai(req, comp, body, tool_parser)
        return req
    chat = decode(body, ChatCompletionRequest, bounds)
    req = openai_request(chat, kind)
    req.messages = chat_messages(body["messages"])
    if chat.logprobs:
        req.logprobs = chat.top_logprobs or 0
    req.max_tokens = chat.max_completion_tokens if chat.max_completion_tokens is not None else chat.max_tokens
    req.tools = parse_tools(body)
    req.splits_reasoning = True
    if req.stream and req.prompt_logprobs is not None:  # (as vLLM: they belong beside the choices)
        raise invalid("'prompt_logprobs' cannot be streamed in chat completions", "prompt_logprobs")
    finish_openai(req, chat, body, tool_parser)
    return req


def chat_messages(messages: list[dict]) -> list[dict]:
    """Chat messages (their types already checked) as chat templates take them."""
    return [
        {"role": m["role"], "content": _message_text(m.get("content"), i), **tool_message(m, i)}
        for i, m in enumerate(messages)
    ]


def sampling_fields(fields: SamplingFields) -> dict[str, Any]:
    """The sampling parameters a body gave (null: SamplingParams' default)."""
    return {k: v for k in SamplingFields.SAMPLING if (v := getattr(fields, k)) is not None}


def openai_request(b: OpenAIFields, kind: RequestKind) -> ParsedRequest:
    """What both OpenAI endpoints' bodies say alike."""
    req = ParsedRequest(kind=kind, model=b.model, sampling=sampling_fields(b))
    req.n = b.n or 1
    req.stream = bool(b.stream)
    req.include_usage = bool(b.stream_options is not None and b.stream_options.include_usage)
    req.logit_bias = _logit_bias(b.logit_bias)
    req.stop = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
    req.stop_token_ids = list(b.stop_token_ids or [])
    req.priority = b.priority
    req.best_of = b.best_of
    req.use_beam_search = bool(b.use_beam_search)
    req.length_penalty = 1.0 if b.length_penalty is None else b.length_penalty
    req.early_stopping = False if b.early_stopping is None else b.early_stopping
    req.prompt_logprobs = b.prompt_logprobs
    return req


def finish_openai(req: ParsedRequest, b: OpenAIFields, body: dict, tool_parser: ToolParser | None) -> None:
    """The rules across fields: groups and beam search, the output constraint and forced tools."""
    _check_group(body, req)
    apply_constraints(req, b, tool_parser)


def apply_constraints(req: ParsedRequest, b: ConstraintFields | dict | None, tool_parser: ToolParser | None) -> None:
    """The body's output constraint (its ConstraintFields, or those fields as a dict), or its
    forced tool call's, compiled once to check them."""
    t0 = time.perf_counter()
    fields = msgspec.structs.asdict(b) if isinstance(b, ConstraintFields) else (b or {})
    req.structured = parse_constraint(fields)
    if req.tools is not None:
        req.structured = tool_constraint(req.tools, tool_parser, req.structured) or req.structured
    req.constraint_check_s = time.perf_counter() - t0
    if req.structured is not None and req.use_beam_search:
        raise invalid("beam search with an output constraint is not supported", "use_beam_search")


def _check_group(body: dict, req: ParsedRequest) -> None:
    """best_of, and beam search (vLLM's extra parameters: use_beam_search, length_penalty,
    early_stopping): one prompt, several sequences sharing its KV blocks."""
    if req.best_of is not None and req.best_of < req.n:
        raise invalid(f"'best_of' ({req.best_of}) must be >= 'n' ({req.n})", "best_of")
    if not req.use_beam_search:
        for key in ("length_penalty", "early_stopping"):
            if body.get(key) is not None:
                raise invalid(f"'{key}' needs 'use_beam_search': true", key)
        if req.stream and (req.best_of or 1) > req.n:
            raise invalid("'best_of' > 'n' cannot be streamed: the best are known only at the end", "best_of")
        return
    for key, neutral in BEAM_NEUTRAL.items():
        if key in body and body[key] not in neutral:
            raise invalid(f"beam search is deterministic: '{key}' does not apply to it", key)
    if req.logprobs is not None:
        raise invalid("beam search does not return logprobs", "logprobs")
    if req.prompt_logprobs is not None:
        raise invalid("beam search does not return prompt logprobs", "prompt_logprobs")
