"""Parse and validate OpenAI request bodies into one typed `ParsedRequest` (400 on anything off).

Checks are explicit rather than delegated to a schema library so each failure names its
parameter in the OpenAI error envelope. A JSON bool is not accepted where a number is expected.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.errors import invalid
from gateway.limits import GatewayLimits

_INT64 = 2**63


@dataclass
class ParsedRequest:
    kind: Literal["completion", "chat"]
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


def parse_request(body: Any, kind: Literal["completion", "chat"], limits: GatewayLimits) -> ParsedRequest:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
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
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            req.prompt_ids = list(prompt)
        elif isinstance(prompt, list) and not prompt:
            raise invalid("'prompt' must not be empty", "prompt")
        else:
            raise invalid("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
        for unsupported in ("echo", "suffix"):
            if body.get(unsupported):
                raise invalid(f"'{unsupported}' is not supported", unsupported)
        if body.get("best_of") not in (None, 1) and body.get("best_of") != body.get("n", 1):
            raise invalid("'best_of' other than n is not supported", "best_of")
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
            clean.append({"role": m["role"], "content": _message_text(m.get("content"), i)})
        req.messages = clean
        if _bool(body, "logprobs", False):
            req.logprobs = _num(body, "top_logprobs", 0, integer=True, lo=0, hi=limits.max_logprobs)
        elif body.get("top_logprobs") is not None:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        req.max_tokens = _num({"max_tokens": mt}, "max_tokens", None, integer=True, lo=1)

    req.n = _num(body, "n", 1, integer=True, lo=1, hi=limits.max_n)
    req.stream = _bool(body, "stream", False)
    opts = body.get("stream_options")
    if opts is not None:
        if not req.stream:
            raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
        if not isinstance(opts, dict):
            raise invalid("'stream_options' must be an object", "stream_options")
        req.include_usage = _bool(opts, "include_usage", False)
    req.temperature = _num(body, "temperature", 1.0, integer=False, lo=0.0, hi=100.0)
    req.top_p = _num(body, "top_p", 1.0, integer=False, lo=0.0, hi=1.0, lo_open=True)
    req.top_k = _num(body, "top_k", -1, integer=True, lo=-1)
    req.min_p = _num(body, "min_p", 0.0, integer=False, lo=0.0, hi=1.0)
    req.seed = _num(body, "seed", None, integer=True, lo=-_INT64, hi=_INT64 - 1)
    req.presence_penalty = _num(body, "presence_penalty", 0.0, integer=False, lo=-2.0, hi=2.0)
    req.frequency_penalty = _num(body, "frequency_penalty", 0.0, integer=False, lo=-2.0, hi=2.0)
    req.repetition_penalty = _num(body, "repetition_penalty", 1.0, integer=False, lo=0.0, hi=10.0, lo_open=True)
    req.ignore_eos = _bool(body, "ignore_eos", False)
    req.min_tokens = _num(body, "min_tokens", 0, integer=True, lo=0)
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
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise invalid("'stop_token_ids' must be a list of integers", "stop_token_ids")
        req.stop_token_ids = ids
    return req
