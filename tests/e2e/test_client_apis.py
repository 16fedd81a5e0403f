"""The clients people point at a server, against a real `pdserve serve` (1P1D, a random-weight
model, the hermes-style chat template, an API key, no --tool-call-parser): the anthropic SDK's
messages.create and messages.stream (text, a stop sequence, max_tokens, a tool round trip,
count_tokens, x-api-key), the openai SDK's responses.create, streamed and not (text, a forced
function call, a JSON schema), the OpenAI Agents SDK's default (Responses) model, and instructor.
Greedy, a streamed answer's text equals the non-streamed one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Annotated

import anthropic
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.cluster import running_server
from tests.gateway.tool_template import QWEN_TOOLS_TEMPLATE

pytestmark = pytest.mark.slow

KEY = "sk-e2e"
GREEDY = {"temperature": 0}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},  # (unbounded, a random model writes digits)
    },
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory) -> Iterator[str]:
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(QWEN_TOOLS_TEMPLATE)
    extra = ["--prefill-workers", "1", "--decode-workers", "1", "--chat-template", str(template), "--api-key", KEY]
    extra += ["--max-model-len", "1024"]  # (the tool list alone is ~500 byte-level tokens)
    with running_server(tiny_llama, *extra) as base:
        yield base


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(oai) -> str:
    return oai.models.list().data[0].id


def test_anthropic_text_streamed_and_not(claude, model):
    kw = dict(model=model, max_tokens=24, messages=ASK, system="Answer briefly.", extra_body=GREEDY)
    m = claude.messages.create(**kw)  # type: ignore[arg-type]
    text = m.content[0].text  # type: ignore[union-attr]
    assert m.type == "message" and m.stop_reason in ("end_turn", "max_tokens") and text
    assert m.usage.output_tokens > 0
    with claude.messages.stream(**kw) as stream:  # type: ignore[arg-type]
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == text and final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    count = claude.messages.count_tokens(model=model, messages=ASK, system="Answer briefly.")
    assert count.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    # a stop sequence taken from the greedy answer ends it there, streamed and not
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want = text[: text.find(stop)]
    cut = claude.messages.create(**kw, stop_sequences=[stop])  # type: ignore[arg-type]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert (cut.content[0].text if cut.content else "") == want  # type: ignore[union-attr]
    with claude.messages.stream(**kw, stop_sequences=[stop]) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and "".join(b.text for b in final.content) == want  # type: ignore[union-attr]
    if m.usage.output_tokens > 2:  # (greedy: its first two tokens again, then cut)
        short = claude.messages.create(
            model=model, max_tokens=2, messages=ASK, system="Answer briefly.", extra_body=GREEDY
        )
        assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_anthropic_tool_round_trip(claude, model):
    tool = {"name": "get_weather", "description": "the forecast", "input_schema": CITY}
    kw = dict(model=model, max_tokens=200, tools=[tool], extra_body=GREEDY)  # (byte-level tokens)
    m = claude.messages.create(messages=ASK, tool_choice={"type": "tool", "name": "get_weather"}, **kw)  # type: ignore[arg-type]
    assert m.stop_reason == "tool_use", m
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather"
    jsonschema.validate(use.input, CITY)
    with claude.messages.stream(
        messages=ASK, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **kw
    ) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and uses and all(u.name == "get_weather" for u in uses)
    for u in uses:
        jsonschema.validate(u.input, CITY)
    turns = [
        *ASK,
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rain, 4 C"}]},
    ]
    answer = claude.messages.create(messages=turns, tool_choice={"type": "none"}, **kw)  # type: ignore[arg-type]
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"


def test_anthropic_key_and_errors(server, model):
    wrong = anthropic.Anthropic(base_url=server, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        wrong.messages.create(model=model, max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    right = anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        right.messages.create(model=model, max_tokens=0, messages=ASK)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]


def test_responses_text_streamed_and_not(oai, model):
    kw = dict(model=model, input="What is the weather in Oslo?", instructions="Answer briefly.", max_output_tokens=24)
    r = oai.responses.create(temperature=0, **kw)
    assert r.status in ("completed", "incomplete") and r.output_text
    events = list(oai.responses.create(temperature=0, stream=True, **kw))
    assert events[0].type == "response.created" and events[-1].type == f"response.{r.status}"
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert streamed == r.output_text == events[-1].response.output_text  # type: ignore[union-attr]
    assert events[-1].response.usage.output_tokens == r.usage.output_tokens  # type: ignore[union-attr]
    with oai.responses.stream(temperature=0, **kw) as stream:  # the SDK's helper (its final: completed only)
        last = list(stream)[-1]
    assert last.type == f"response.{r.status}" and last.response.output_text == r.output_text  # type: ignore[union-attr]


def test_responses_function_call_and_json_schema(oai, model):
    tool = {"type": "function", "name": "get_weather", "parameters": CITY}
    r = oai.responses.create(
        model=model,
        input="What is the weather in Oslo?",
        tools=[tool],
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=200,
    )
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), CITY)
    events = list(
        oai.responses.create(
            model=model,
            input="What is the weather in Oslo?",
            tools=[tool],
            tool_choice={"type": "function", "name": "get_weather"},
            temperature=0,
            max_output_tokens=200,
            stream=True,
        )
    )
    pieces = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    assert pieces == call.arguments
    fmt = {"type": "json_schema", "name": "place", "schema": CITY}
    answer = oai.responses.create(
        model=model,
        input="Which city?",
        text={"format": fmt},
        temperature=0,
        max_output_tokens=200,  # type: ignore[typeddict-item]
    )
    jsonschema.validate(json.loads(answer.output_text), CITY)


def test_openai_agents_sdk_with_its_default_responses_model(server, model):
    """The OpenAI Agents SDK's default model speaks the Responses API: an agent with an output type
    gets its object (text.format json_schema), and an agent with a function tool calls it (forced
    by name) with valid arguments, streamed and not."""
    agents = pytest.importorskip("agents")
    asked: list[dict] = []

    class Place(BaseModel):
        city: str = Field(max_length=8)
        days: int = Field(ge=1, le=14)

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=8)], days: Annotated[int, Field(ge=1, le=14)]) -> str:
        """The forecast for a city."""
        asked.append({"city": city, "days": days})
        return "rain, 4 C"

    async def scenario() -> tuple[object, str, str]:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
        agents.set_default_openai_client(client, use_for_tracing=False)
        agents.set_default_openai_api("responses")
        agents.set_tracing_disabled(True)
        # a structured answer ends when its JSON does (a random model's free text would run into
        # max_tokens, which the SDK takes as a failed run, as it does OpenAI's "incomplete")
        settings = agents.ModelSettings(temperature=0, max_tokens=200)
        plain = agents.Agent(
            name="plain", instructions="Be brief.", model=model, model_settings=settings, output_type=Place
        )
        place = (await agents.Runner.run(plain, "What is the weather in Oslo?")).final_output
        forced = agents.ModelSettings(temperature=0, max_tokens=200, tool_choice="get_weather")
        agent = agents.Agent(
            name="weather",
            model=model,
            tools=[get_weather],
            model_settings=forced,
            tool_use_behavior="stop_on_first_tool",  # (a second, unforced turn would need --tool-call-parser)
        )
        answer = (await agents.Runner.run(agent, "What is the weather in Oslo?")).final_output
        run = agents.Runner.run_streamed(agent, "What is the weather in Oslo?")
        async for _ in run.stream_events():
            pass
        return place, answer, run.final_output

    place, answer, streamed = asyncio.run(scenario())
    assert isinstance(place, Place)
    assert answer == streamed == "rain, 4 C"
    assert len(asked) == 2 and asked[0] == asked[1] and isinstance(asked[0]["city"], str)


@pytest.mark.parametrize("mode", ["JSON_SCHEMA", "TOOLS"])
def test_instructor_returns_its_object_with_no_parser_flag(server, model, mode):
    """instructor's JSON_SCHEMA mode (response_format json_schema) and TOOLS mode (a named
    tool_choice, forced as one call though the server has no --tool-call-parser)."""
    import instructor

    class Place(BaseModel):
        city: str = Field(max_length=8)
        days: int = Field(ge=1, le=14)

    client = instructor.from_openai(
        openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60),
        mode=getattr(instructor.Mode, mode),
    )
    place = client.chat.completions.create(
        model=model,
        response_model=Place,
        messages=[{"role": "user", "content": "Where is it raining?"}],
        temperature=0,
        max_tokens=200,
        max_retries=0,
    )
    assert isinstance(place, Place)
