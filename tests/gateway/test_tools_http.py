"""Tools over HTTP through a scripted stub backend and the official openai client: the tools and
tool turns reach the chat template, calls come back as OpenAI's message.tool_calls (finish
"tool_calls"), streamed as OpenAI's deltas that add up to the same calls; required / a named
function travel as a grammar constraint; bad tool input is a 400 naming its field."""

from __future__ import annotations

import json

import pytest
from openai import BadRequestError, OpenAI
from starlette.testclient import TestClient

from pdserve.gateway.app import create_app
from pdserve.protocol.messages import TokenOutput
from tests.gateway.stub_backend import StubBackend
from tests.gateway.tool_template import QWEN_TOOLS_TEMPLATE

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "forecast by city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]
SCRIPT = (
    'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)
ASK = [{"role": "user", "content": "weather in Paris?"}]


class ScriptedBackend(StubBackend):
    """Answers every request with `script`'s tokens, one per output, then "stop"."""

    def __init__(self, tokenizer, script: str) -> None:
        super().__init__()
        self.ids = tokenizer.encode(script, add_special_tokens=False)

    async def outputs(self, request_id, prompt_token_ids, sampling):
        self.sampling[request_id] = sampling
        self.prompts[request_id] = list(prompt_token_ids)
        for i, token in enumerate(self.ids):
            last = i == len(self.ids) - 1
            yield TokenOutput(
                request_id=request_id,
                worker_id="stub",
                index=i,
                token_ids=[token],
                finish_reason="stop" if last else None,
            )


def client(
    tokenizer, script: str = SCRIPT, parser: str | None = "hermes", template: str | None = QWEN_TOOLS_TEMPLATE
) -> tuple[OpenAI, ScriptedBackend]:
    backend = ScriptedBackend(tokenizer, script)
    app = create_app(
        backend,
        tokenizer,
        model_name="m",
        max_model_len=2048,
        chat_template=template,
        tool_call_parser=parser,
    )
    return OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0, http_client=TestClient(app)), backend


def streamed(c: OpenAI, **kw) -> tuple[str, list[dict], str | None, list]:
    """(content, tool calls, finish_reason, chunks) of a streamed answer, assembled from deltas."""
    chunks = list(c.chat.completions.create(stream=True, **{"model": "m", **kw}))
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.id is not None:
                    assert tc.index not in calls and tc.type == "function" and tc.function.arguments == ""
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
                else:
                    calls[tc.index]["arguments"] += tc.function.arguments
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, chunks


def test_auto_calls_whole_and_streamed(tokenizer):
    c, backend = client(tokenizer)
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking both."
    calls = choice.message.tool_calls or []
    assert [(t.type, t.function.name) for t in calls] == [("function", "get_weather"), ("function", "get_time")]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert all(t.id.startswith("call_") for t in calls)
    assert backend.sampling[r.id].structured is None  # auto: unconstrained, parsed

    content, s_calls, finish, chunks = streamed(c, messages=ASK, tools=TOOLS)
    assert finish == "tool_calls" and content == "Checking both."
    assert [(t["name"], t["arguments"]) for t in s_calls] == [(t.function.name, t.function.arguments) for t in calls]
    pieces = [ch.choices[0].delta.content or "" for ch in chunks if ch.choices]
    assert not any("<" in p or "tool_call" in p for p in pieces)  # no markup leaks as content
    args_chunks = [ch for ch in chunks if ch.choices and ch.choices[0].delta.tool_calls]
    assert len(args_chunks) > 4  # the arguments came in pieces


def test_tools_and_tool_turns_reach_the_template(tokenizer):
    c, backend = client(tokenizer)
    turns = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4 C"},
    ]
    r = c.chat.completions.create(model="m", messages=turns, tools=TOOLS)  # type: ignore[arg-type]
    prompt = tokenizer.decode(backend.prompts[r.id])
    assert '"name": "get_weather"' in prompt and "forecast by city" in prompt  # the tool list
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in prompt
    assert "<tool_response>\nrain, 4 C\n</tool_response>" in prompt


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_forced_calls_travel_as_a_grammar(tokenizer, choice):
    c, backend = client(tokenizer)
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    structured = backend.sampling[r.id].structured
    assert structured is not None and structured.kind == "lark"
    assert "get_time" in structured.spec and ("get_weather" in structured.spec) == (choice == "required")
    assert r.choices[0].finish_reason == "tool_calls"


def test_a_template_without_tools_still_gets_the_forced_grammar(tokenizer):
    c, backend = client(tokenizer, template=None)  # the tokenizer's own template ignores tools
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required")
    assert "get_weather" not in tokenizer.decode(backend.prompts[r.id])
    structured = backend.sampling[r.id].structured
    assert structured is not None and structured.kind == "lark"
    assert r.choices[0].finish_reason == "tool_calls"


def test_choice_none_leaves_the_markup_as_content(tokenizer):
    c, backend = client(tokenizer)
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == SCRIPT and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"
    assert "forecast by city" in tokenizer.decode(next(iter(backend.prompts.values())))


def test_plain_answer_with_tools_is_content(tokenizer):
    c, _ = client(tokenizer, script="No tool needed: 42.")
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    assert r.choices[0].message.content == "No tool needed: 42." and r.choices[0].finish_reason == "stop"
    content, calls, finish, _ = streamed(c, messages=ASK, tools=TOOLS)
    assert (content, calls, finish) == ("No tool needed: 42.", [], "stop")


@pytest.mark.parametrize(
    "extra,param,match",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice", "empty"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", r"tools\[0\]"),
        ({"tools": [{"type": "retrieval"}]}, "tools", r"tools\[0\]"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 5}}}
                ]
            },
            "tools",
            r"tools\[0\]\.function\.parameters",
        ),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "same name"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "boolean"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "together",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages", "tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{"}}],
                    }
                ]
            },
            "messages",
            "not JSON",
        ),
    ],
)
def test_bad_tool_input_is_a_400_naming_the_field(tokenizer, extra, param, match):
    c, backend = client(tokenizer)
    with pytest.raises(BadRequestError, match=match) as e:
        c.chat.completions.create(model="m", **{"messages": ASK, **extra})
    assert e.value.body["param"] == param  # type: ignore[index]
    assert not backend.sampling  # nothing reached a worker
    assert c.chat.completions.create(model="m", messages=ASK).choices[0].finish_reason == "stop"  # still up


def test_auto_needs_a_parser(tokenizer):
    c, _ = client(tokenizer, parser=None)
    with pytest.raises(BadRequestError, match="--tool-call-parser"):
        c.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == SCRIPT


FORCED = '[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}]'


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_need_no_parser(tokenizer, choice):
    """As vLLM: required or a named function without --tool-call-parser is forced as a JSON list
    of calls (gateway/tools/json_list.py), read back as tool calls, streamed and not alike; a named
    function (or parallel_tool_calls false) is exactly one call."""
    c, backend = client(tokenizer, script=FORCED, parser=None)
    parallel = choice == "required"
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=choice)  # type: ignore[arg-type]
    structured = backend.sampling[r.id].structured
    assert structured is not None and structured.kind == "lark"
    assert structured.spec.startswith('start: "[" call')
    assert ('(", " call)*' in structured.spec) == parallel  # a named function: one call, no more
    assert ("get_time" in structured.spec) == parallel
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in message.tool_calls or []] == [
        ("get_weather", {"city": "Oslo", "days": 1})
    ]
    content, calls, finish, _ = streamed(c, messages=ASK, tools=TOOLS, tool_choice=choice)
    assert (content, finish) == ("", "tool_calls")
    assert [(t["name"], json.loads(t["arguments"])) for t in calls] == [("get_weather", {"city": "Oslo", "days": 1})]


def test_constrained_requests_are_counted_by_kind(tokenizer):
    backend = ScriptedBackend(tokenizer, SCRIPT)
    app = create_app(backend, tokenizer, model_name="m", max_model_len=2048, tool_call_parser="hermes")
    http = TestClient(app)
    c = OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0, http_client=http)
    c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required")
    c.chat.completions.create(model="m", messages=ASK, tools=TOOLS)  # auto: not constrained
    c.chat.completions.create(model="m", messages=ASK, response_format={"type": "json_object"})
    text = http.get("/metrics").text
    assert 'pdserve_structured_requests_total{kind="tool_call"} 1.0' in text
    assert 'pdserve_structured_requests_total{kind="json_object"} 1.0' in text
    assert "pdserve_structured_compile_seconds_count 2.0" in text


def test_a_marker_the_tokenizer_holds_as_a_special_token_is_seen_by_auto(tokenizer):
    """Mistral's `[TOOL_CALLS]` is one special token in its tokenizer: decoding skips special
    tokens, so the detokenizer keeps the parser's markers (and only them) for requests with tools."""
    import copy

    from pdserve.gateway.text_decoder import special_markers

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[OTHER]"]})
    script = 'Sure.[OTHER][TOOL_CALLS][{"name": "get_time", "arguments": {}}]'
    (marker,) = special_markers(tok, ("[TOOL_CALLS]",))
    assert marker in tok.encode(script, add_special_tokens=False)  # one special token in the output
    c, _ = client(tok, script=script, parser="mistral")
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure."  # [OTHER] skipped
    assert [t.function.name for t in choice.message.tool_calls or []] == ["get_time"]
    content, calls, finish, _ = streamed(c, messages=ASK, tools=TOOLS)
    assert (content, [t["name"] for t in calls], finish) == ("Sure.", ["get_time"], "tool_calls")
    plain = c.chat.completions.create(model="m", messages=ASK)  # no tools: special tokens skipped as ever
    assert plain.choices[0].message.content == 'Sure.[{"name": "get_time", "arguments": {}}]'


def test_a_named_function_is_called_once_with_a_parser_too(tokenizer):
    """A named tool_choice forced `call (sep call)*` with parallel_tool_calls (the default): the
    model wrote calls of it until max_tokens. OpenAI and vLLM answer one call."""
    c, backend = client(tokenizer)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice=named)  # type: ignore[arg-type]
    structured = backend.sampling[r.id].structured
    assert structured is not None and "call)*" not in structured.spec
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS, tool_choice="required")
    structured = backend.sampling[r.id].structured
    assert structured is not None and "call)*" in structured.spec  # required: one call or more
