"""Parse and validate OpenAI request bodies into one typed `ParsedRequest` (400 on anything off).

Checks are explicit rather than delegated to a schema library so each failure names its
parameter in the OpenAI error envelope. A JSON bool is not accepted where a number is expected.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from pdserve.gateway.constraints import CONSTRAINT_FIELDS, parse_constraint
from pdserve.gateway.errors import invalid
from pdserve.gateway.limits import GatewayLimits
from pdserve.gateway.tools.constraint import tool_constraint
from pdserve.gateway.tools.parser import ToolParser
from pdserve.gateway.tools.request import TOOL_FIELDS, ToolRequest, parse_tools, tool_message
from pdserve.protocol.sampling import StructuredOutput

_INT64 = 2**63

RequestKind = Literal["completion", "chat"]  # the endpoint: /v1/completions or /v1/chat/completions


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
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # top-N alternatives; None = no logprobs
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, bias) added to logits
    # several sequences from one prompt (engine/sequence_group.py)
    best_of: int | None = None  # sequences generated; the n with the highest cumulative logprob return
    use_beam_search: bool = False  # vLLM's extra parameter: beam width best_of (or n)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    priority: int | None = None  # vLLM's: lower is admitted first; None = the API key's default
    structured: StructuredOutput | None = None  # response_format / structured_outputs / guided_* (constraints.py)
    tools: ToolRequest | None = None  # chat's tools and tool_choice (gateway/tools/)
    constraint_check_s: float = 0.0  # spent compiling its constraint and tool schemas to check them

    @property
    def constraint_kind(self) -> str | None:
        """What constrains its output, for metrics: a StructuredOutput kind, or tool_call."""
        if self.structured is None:
            return None
        return "tool_call" if self.tools is not None and self.tools.forced else self.structured.kind

    @property
    def num_seqs(self) -> int:
        """Sequences generated: best_of (the beam width with beam search), else n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_group(self) -> bool:
        """One backend request whose choices come back by index (else n independent requests)."""
        return self.n > 1 or self.use_beam_search or (self.best_of or 1) > 1


class Range(NamedTuple):
    """Accepted values of a numeric field (also what gateway/openapi.py publishes)."""

    integer: bool
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo itself is refused

    def admits(self, value: float) -> bool:
        return (self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)) and (
            self.hi is None or value <= self.hi
        )


# Sampling fields both endpoints take; their defaults are ParsedRequest's.
SAMPLING_RANGES = {
    "temperature": Range(False, 0.0, 100.0),
    "top_p": Range(False, 0.0, 1.0, lo_open=True),
    "top_k": Range(True, -1, _INT64 - 1),  # more overflowed torch.tensor in a worker's sampler: it crashed
    "min_p": Range(False, 0.0, 1.0),
    "seed": Range(True, -_INT64, _INT64 - 1),
    "presence_penalty": Range(False, -2.0, 2.0),
    "frequency_penalty": Range(False, -2.0, 2.0),
    "repetition_penalty": Range(False, 0.0, 10.0, lo_open=True),
    "min_tokens": Range(True, 0),
}
STOP_TOKEN_ID = Range(True, -_INT64, _INT64 - 1)  # what msgpack carries to the workers
LENGTH_PENALTY = Range(False, -10.0, 10.0)
PRIORITY = Range(True, -_INT64, _INT64 - 1)  # vLLM's `priority`: any integer, lower first
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


def _num(body: dict, key: str, default, *, integer: bool, lo=None, hi=None, lo_open=False):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(f"'{key}' must be a {'integer' if integer else 'number'}", key)
    if integer:
        if isinstance(value, float):
            if not value.is_integer():
                raise invalid(f"'{key}' must be an integer, got {value}", key)
            value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise invalid(f"'{key}' must be finite", key)
    if lo is not None and (value <= lo if lo_open else value < lo):
        raise invalid(f"'{key}' must be {'>' if lo_open else '>='} {lo}, got {value}", key)
    if hi is not None and value > hi:
        raise invalid(f"'{key}' must be <= {hi}, got {value}", key)
    return value


def _bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"'{key}' must be a boolean", key)
    return value


def _is_int(value: Any) -> bool:
    """A JSON integer: 5.0 counts (as in `_num`), a bool does not."""
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


MAX_LOGIT_BIAS = 100.0  # OpenAI's range: [-100, 100]
_COMMON_FIELDS = {
    "model",
    "n",
    "stream",
    "stream_options",
    *SAMPLING_RANGES,
    "ignore_eos",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "user",
    "best_of",
    "use_beam_search",
    "length_penalty",
    "early_stopping",
    "priority",
    *CONSTRAINT_FIELDS,
}  # user: the caller's end-user id, kept by nobody
FIELDS = {
    "completion": _COMMON_FIELDS | {"prompt", "max_tokens", "logprobs", "echo", "suffix"},
    "chat": _COMMON_FIELDS
    | {
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        *TOOL_FIELDS,
    },
}


def _refuse_what_is_not_implemented(body: dict, kind: str) -> None:
    """Nothing is ignored silently: an unknown field, or one we do not implement, is a 400."""
    unknown = sorted(set(body) - FIELDS[kind])
    if unknown:
        raise invalid(f"unrecognized request argument '{unknown[0]}'", unknown[0])


def _logit_bias(value: Any) -> list[tuple[int, float]]:
    """{"token id": bias in [-100, 100]} -> sorted (id, bias) pairs; ids are checked against the
    vocabulary by the caller."""
    if value is None:
        return []
    if not isinstance(value, dict):
        raise invalid("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) < 19):
            raise invalid(f"logit_bias key {key!r} is not a token id", "logit_bias")
        if (
            isinstance(bias, bool)
            or not isinstance(bias, (int, float))
            or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS
        ):
            raise invalid(f"logit_bias[{key}] must be a number in [-100, 100]", "logit_bias")
        out.append((int(key), float(bias)))
    return sorted(out)


def parse_request(
    body: Any, kind: RequestKind, limits: GatewayLimits, tool_parser: ToolParser | None = None
) -> ParsedRequest:
    """`tool_parser`: --tool-call-parser's, which reads tool calls and writes the grammar of a
    forced one (chat requests with tools other than tool_choice none need one)."""
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    _refuse_what_is_not_implemented(body, kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise invalid("'model' must be a string", "model")
    req = ParsedRequest(kind=kind, model=model)

    if kind == "completion":
        prompt = body.get("prompt")
        if prompt is None:
            raise invalid("'prompt' is required", "prompt")
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
        if _bool(body, "echo", False):
            raise invalid("'echo' is not supported", "echo")
        if body.get("suffix") not in (None, ""):
            raise invalid("'suffix' is not supported", "suffix")
        logprobs = _num(body, "logprobs", None, integer=True, lo=0, hi=limits.max_logprobs)
        req.logprobs = logprobs
        req.max_tokens = _num(body, "max_tokens", 16, integer=True, lo=1)
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid("'messages' must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise invalid(f"messages[{i}] must be an object with a string 'role'", "messages")
            clean.append({"role": m["role"], "content": _message_text(m.get("content"), i), **tool_message(m, i)})
        req.messages = clean
        if _bool(body, "logprobs", False):
            req.logprobs = _num(body, "top_logprobs", 0, integer=True, lo=0, hi=limits.max_logprobs)
        elif body.get("top_logprobs") is not None:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        max_tokens = _num(body, "max_tokens", None, integer=True, lo=1)  # the older name: checked too
        req.max_tokens = _num(body, "max_completion_tokens", max_tokens, integer=True, lo=1)

    req.n = _num(body, "n", 1, integer=True, lo=1, hi=limits.max_n)
    req.stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None:
        if not req.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(opts, dict):
            raise invalid("'stream_options' must be an object", "stream_options")
        req.include_usage = _bool(opts, "include_usage", False)
    for key, bounds in SAMPLING_RANGES.items():
        setattr(req, key, _num(body, key, getattr(req, key), **bounds._asdict()))
    req.ignore_eos = _bool(body, "ignore_eos", False)
    req.logit_bias = _logit_bias(body.get("logit_bias"))
    if body.get("user") is not None and not isinstance(body.get("user"), str):
        raise invalid("'user' must be a string", "user")
    stop = body.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise invalid("'stop' must be a non-empty string or a list of them", "stop")
        if len(stops) > limits.max_stop:
            raise invalid(f"at most {limits.max_stop} stop strings", "stop")
        if any(len(s) > limits.max_stop_len for s in stops):
            raise invalid(f"stop strings must be at most {limits.max_stop_len} characters", "stop")
        req.stop = stops
    ids = body.get("stop_token_ids")
    if ids is not None:
        stop_ids = _token_ids(ids)
        if stop_ids is None or not all(STOP_TOKEN_ID.admits(t) for t in stop_ids):
            raise invalid("'stop_token_ids' must be a list of 64-bit integers", "stop_token_ids")
        req.stop_token_ids = stop_ids
    req.priority = _num(body, "priority", None, **PRIORITY._asdict())
    _parse_group(body, req, limits)
    t0 = time.perf_counter()
    req.structured = parse_constraint(body)
    if kind == "chat":
        req.tools = parse_tools(body)
        if req.tools is not None:
            req.structured = tool_constraint(req.tools, tool_parser, req.structured) or req.structured
    req.constraint_check_s = time.perf_counter() - t0
    if req.structured is not None and req.use_beam_search:
        raise invalid("beam search with an output constraint is not supported", "use_beam_search")
    return req


def _parse_group(body: dict, req: ParsedRequest, limits: GatewayLimits) -> None:
    """best_of, and beam search (vLLM's extra parameters: use_beam_search, length_penalty,
    early_stopping): one prompt, several sequences sharing its KV blocks."""
    req.best_of = _num(body, "best_of", None, integer=True, lo=1, hi=limits.max_n)
    if req.best_of is not None and req.best_of < req.n:
        raise invalid(f"'best_of' ({req.best_of}) must be >= 'n' ({req.n})", "best_of")
    req.use_beam_search = _bool(body, "use_beam_search", False)
    req.length_penalty = _num(body, "length_penalty", 1.0, **LENGTH_PENALTY._asdict())
    early = body.get("early_stopping")
    early = False if early is None else early
    if not isinstance(early, bool) and early != "never":
        raise invalid("'early_stopping' must be true, false or \"never\"", "early_stopping")
    req.early_stopping = early
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
