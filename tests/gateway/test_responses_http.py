"""OpenAI's Responses API through the openai SDK against the app over scripted stub outputs:
text streamed and not (the same text), the SDK's stream helper, function calls forced without a
parser and sent back with their output, text.format, max_output_tokens, and the stateless 400."""

from __future__ import annotations

import json

import openai
import pytest
from starlette.testclient import TestClient

from pdserve.gateway.app import create_app
from tests.gateway.stub_backend import StubBackend
from tests.gateway.test_tools_http import ScriptedBackend
from tests.gateway.tool_template import QWEN_TOOLS_TEMPLATE

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "forecast by city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CALL = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'


def client_for(backend, tokenizer) -> openai.OpenAI:
    app = create_app(backend, tokenizer, model_name="m", max_model_len=2048, chat_template=QWEN_TOOLS_TEMPLATE)
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0, http_client=TestClient(app))


def scripted(tokenizer, script: str) -> tuple[openai.OpenAI, ScriptedBackend]:
    backend = ScriptedBackend(tokenizer, script)
    return client_for(backend, tokenizer), backend


def test_text_streamed_and_not_alike(tokenizer):
    c, backend = scripted(tokenizer, "Hello there. It rains.")
    r = c.responses.create(model="m", input="weather in Oslo?", instructions="Be brief.", temperature=0)
    assert r.object == "response" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output_text == "Hello there. It rains." and r.output[0].type == "message"
    prompt = tokenizer.decode(backend.prompts[r.id])
    assert "Be brief." in prompt and "weather in Oslo?" in prompt
    assert r.usage is not None and r.usage.input_tokens == len(backend.prompts[r.id]) and r.usage.output_tokens > 0
    events = list(c.responses.create(model="m", input="weather in Oslo?", instructions="Be brief.", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == r.output_text and len(deltas) > 1
    assert events[-1].response.output_text == r.output_text  # type: ignore[union-attr]
    with c.responses.stream(model="m", input="weather in Oslo?") as stream:
        final = stream.get_final_response()
    assert final.output_text == r.output_text


def test_a_forced_call_and_its_output_sent_back(tokenizer):
    c, backend = scripted(tokenizer, CALL)
    r = c.responses.create(
        model="m", input="weather in Oslo?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Oslo"} and call.call_id.startswith("call_")
    structured = backend.sampling[r.id].structured
    assert structured is not None and "call)*" not in structured.spec  # a named function: one call
    events = list(c.responses.create(model="m", input="weather?", tools=[WEATHER], tool_choice="required", stream=True))
    added = [e.item for e in events if e.type == "response.output_item.added"]  # type: ignore[union-attr]
    assert [i.type for i in added] == ["function_call"]
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    assert json.loads(pieces) == {"city": "Oslo"}
    done = events[-1].response.output[0]  # type: ignore[union-attr]
    assert done.type == "function_call" and done.arguments == pieces  # type: ignore[union-attr]
    back = c.responses.create(
        model="m",
        input=[
            {"role": "user", "content": "weather in Oslo?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "rain, 4 C"},
        ],
        tools=[WEATHER],
        tool_choice="none",
    )
    prompt = tokenizer.decode(backend.prompts[back.id])
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert "<tool_response>\nrain, 4 C\n</tool_response>" in prompt


def test_text_format_and_max_output_tokens(tokenizer):
    c, backend = scripted(tokenizer, '{"city": "Oslo"}')
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    r = c.responses.create(
        model="m", input="city?", text={"format": {"type": "json_schema", "name": "place", "schema": schema}}
    )
    structured = backend.sampling[r.id].structured
    assert structured is not None and structured.kind == "json_schema" and json.loads(r.output_text) == {"city": "Oslo"}
    short = client_for(StubBackend(), tokenizer).responses.create(model="m", input="hello", max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens" and short.usage.output_tokens == 3  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"tools": [WEATHER]}, "tool_choice"),  # auto needs --tool-call-parser
    ],
)
def test_bad_requests_are_400s_naming_the_field(tokenizer, kw, param):
    c, backend = scripted(tokenizer, "x")
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(**{"model": "m", "input": "hi", **kw})
    assert e.value.body["param"] == param  # type: ignore[index]
    assert not backend.sampling
