"""Forced tool calls on a random-weight model (the grammar alone makes them calls) through the
official openai client, 1P1D (P samples the first token under the call's grammar, D rebuilds its
matcher) and colocated: tool_choice required and a named function return calls of the allowed
functions whose arguments validate against their parameters, and the streamed deltas add up to
the non-streamed answer of the same seed."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI

from tests.e2e.cluster import running_server
from tests.gateway.test_tools_http import streamed
from tests.gateway.tool_template import QWEN_TOOLS_TEMPLATE

pytestmark = pytest.mark.slow

MODES = {"1P1D": ["--prefill-workers", "1", "--decode-workers", "1"], "colocated": ["--colocated"]}
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 6},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 2},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [{"type": "function", "function": {"name": n, "parameters": s}} for n, s in SCHEMAS.items()]
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}


@pytest.mark.parametrize("mode", MODES)
def test_forced_calls_validate_streamed_and_not(tiny_llama, tmp_path, mode):
    template = tmp_path / "tools.jinja"
    template.write_text(QWEN_TOOLS_TEMPLATE)
    extra = ["--tool-call-parser", "hermes", "--chat-template", str(template), "--max-model-len", "1024"]
    with running_server(tiny_llama, *MODES[mode], *extra) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        messages = [{"role": "user", "content": "weather in Paris?"}]
        for label, choice in CHOICES.items():
            allowed = set(SCHEMAS) if label == "required" else {"get_weather"}
            for seed in range(3):
                kw = dict(
                    model=model,
                    messages=messages,
                    tools=TOOLS,
                    tool_choice=choice,
                    parallel_tool_calls=False,
                    max_tokens=200,
                    seed=seed,
                    temperature=0.0 if seed == 0 else 1.0,
                )
                r = client.chat.completions.create(**kw)  # type: ignore[call-overload]
                answer = r.choices[0]
                assert answer.finish_reason == "tool_calls", answer
                calls = answer.message.tool_calls or []
                assert len(calls) == 1 and answer.message.content is None, answer.message
                for call in calls:
                    assert call.function.name in allowed and call.id.startswith("call_")
                    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
                content, s_calls, finish, _ = streamed(client, **kw)
                assert finish == "tool_calls" and content == ""
                assert [(c["name"], c["arguments"]) for c in s_calls] == [
                    (c.function.name, c.function.arguments) for c in calls
                ]
