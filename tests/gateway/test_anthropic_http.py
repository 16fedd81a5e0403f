"""Anthropic's Messages API through the anthropic SDK against the app over scripted stub outputs:
text, streamed and not (the same text), stop_reason and stop_sequence, max_tokens, a tool round
trip (forced without a parser), count_tokens, x-api-key, and Anthropic's error shape."""

from __future__ import annotations

import anthropic
import pytest
from starlette.testclient import TestClient

from pdserve.gateway.app import create_app
from pdserve.gateway.tenants import ApiKey, TenantDirectory
from tests.gateway.stub_backend import StubBackend
from tests.gateway.test_tools_http import ScriptedBackend
from tests.gateway.tool_template import QWEN_TOOLS_TEMPLATE

ASK = [{"role": "user", "content": "weather in Oslo?"}]
WEATHER = {
    "name": "get_weather",
    "description": "forecast by city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def client_for(backend, tokenizer, **kw) -> anthropic.Anthropic:
    app = create_app(backend, tokenizer, model_name="m", max_model_len=2048, chat_template=QWEN_TOOLS_TEMPLATE, **kw)
    return anthropic.Anthropic(base_url="http://testserver", api_key="x", max_retries=0, http_client=TestClient(app))


def scripted(tokenizer, script: str, **kw) -> tuple[anthropic.Anthropic, ScriptedBackend]:
    backend = ScriptedBackend(tokenizer, script)
    return client_for(backend, tokenizer, **kw), backend


def test_text_streamed_and_not_alike(tokenizer):
    c, backend = scripted(tokenizer, "Hello there. It rains.")
    m = c.messages.create(model="m", max_tokens=50, messages=ASK, system="Be brief.", extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert [(b.type, b.text) for b in m.content] == [("text", "Hello there. It rains.")]  # type: ignore[union-attr]
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    prompt = tokenizer.decode(backend.prompts[m.id])
    assert "Be brief." in prompt and "weather in Oslo?" in prompt
    assert m.usage.input_tokens == len(backend.prompts[m.id]) and m.usage.output_tokens > 0
    assert backend.sampling[m.id].temperature == 0
    with c.messages.stream(model="m", max_tokens=50, messages=ASK, system="Be brief.") as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == "Hello there. It rains." and len(pieces) > 1
    assert final.content[0].text == "Hello there. It rains." and final.stop_reason == "end_turn"  # type: ignore[union-attr]
    assert final.usage.output_tokens == m.usage.output_tokens
    count = c.messages.count_tokens(model="m", messages=ASK, system="Be brief.")
    assert count.input_tokens == m.usage.input_tokens


def test_a_stop_sequence_ends_it_and_is_named(tokenizer):
    c, _ = scripted(tokenizer, "Hello there. It rains.")
    m = c.messages.create(model="m", max_tokens=50, messages=ASK, stop_sequences=["It r", "zzz"])
    assert m.content[0].text == "Hello there. " and m.stop_reason == "stop_sequence"  # type: ignore[union-attr]
    assert m.stop_sequence == "It r"
    with c.messages.stream(model="m", max_tokens=50, messages=ASK, stop_sequences=["It r"]) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "Hello there. " and final.stop_sequence == "It r"  # type: ignore[union-attr]


def test_a_json_schema_output_format_constrains_the_answer(tokenizer):
    c, backend = scripted(tokenizer, '{"city": "Oslo"}')
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    m = c.messages.create(
        model="m", max_tokens=20, messages=ASK, output_config={"format": {"type": "json_schema", "schema": schema}}
    )
    structured = backend.sampling[m.id].structured
    assert structured is not None and structured.kind == "json_schema" and '"city"' in structured.spec


def test_max_tokens(tokenizer):
    c = client_for(StubBackend(), tokenizer)
    m = c.messages.create(model="m", max_tokens=3, messages=ASK)
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3


def test_a_tool_round_trip_without_a_parser(tokenizer):
    c, backend = scripted(tokenizer, '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    m = c.messages.create(
        model="m", max_tokens=50, messages=ASK, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"}
    )
    assert m.stop_reason == "tool_use"
    (use,) = m.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Oslo"}
    assert use.id.startswith("toolu_")
    structured = backend.sampling[m.id].structured
    assert structured is not None and "call)*" not in structured.spec  # one call
    with c.messages.stream(
        model="m", max_tokens=50, messages=ASK, tools=[WEATHER], tool_choice={"type": "any"}
    ) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", {"city": "Oslo"})]  # type: ignore[union-attr]
    assert final.stop_reason == "tool_use"
    # the result goes back: the template sees the call and its result
    turns = [
        *ASK,
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain, 4 C"}]},
    ]
    answer = c.messages.create(model="m", max_tokens=50, messages=turns, tools=[WEATHER], tool_choice={"type": "none"})
    prompt = tokenizer.decode(backend.prompts[answer.id])
    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in prompt
    assert "<tool_response>\nrain, 4 C\n</tool_response>" in prompt
    assert answer.content[0].type == "text"


@pytest.mark.parametrize(
    "kw,status",
    [
        ({"max_tokens": 0}, 400),
        ({"max_tokens": 5, "extra_body": {"top_p": 2}}, 400),
        ({"max_tokens": 5, "model": "other"}, 404),
        ({"max_tokens": 5, "tools": [WEATHER]}, 400),  # auto needs --tool-call-parser
        ({"max_tokens": 5, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, 400),
    ],
)
def test_errors_have_anthropics_shape(tokenizer, kw, status):
    c, backend = scripted(tokenizer, "x")
    with pytest.raises(anthropic.APIStatusError) as e:
        c.messages.create(**{"model": "m", "messages": ASK, **kw})
    assert e.value.status_code == status
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    assert not backend.sampling


def test_x_api_key_names_the_tenant(tokenizer):
    tenants = TenantDirectory.build(None, [ApiKey("team", "sk-team")])
    backend = ScriptedBackend(tokenizer, "ok")
    app = create_app(backend, tokenizer, model_name="m", max_model_len=2048, tenants=tenants)
    http = TestClient(app)
    good = anthropic.Anthropic(base_url="http://testserver", api_key="sk-team", max_retries=0, http_client=http)
    assert good.messages.create(model="m", max_tokens=5, messages=ASK).content[0].text == "ok"  # type: ignore[union-attr]
    bad = anthropic.Anthropic(base_url="http://testserver", api_key="sk-wrong", max_retries=0, http_client=http)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="m", max_tokens=5, messages=ASK)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid or missing API key"},
    }
    assert 'pdserve_key_prompt_tokens_total{key="team"}' in http.get("/metrics").text
