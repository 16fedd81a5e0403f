"""--reasoning-parser (qwen3, deepseek_r1): chat answers carry the reasoning apart as
`reasoning_content`, streamed as its own deltas; what was streamed adds up to the whole answer's
split at every cut, and tool calls are read in the answer only."""

from __future__ import annotations

import pytest
from openai import OpenAI
from starlette.testclient import TestClient

from pdserve.gateway.app import create_app
from pdserve.gateway.reasoning import REASONING_PARSERS, ReasoningStream
from tests.gateway.test_tools_http import TOOLS, ScriptedBackend, streamed
from tests.gateway.tool_template import QWEN_TOOLS_TEMPLATE

ASK = [{"role": "user", "content": "2 + 2?"}]
CASES = [
    ("<think>\nhmm, so</think>\n\nThe answer.", False),
    ("plain answer </think> x", False),
    ("reason a bit</think>\n\nok", True),
    ("cut while thinking", True),
    ("<think>never ends", False),
    ("<thin", False),
]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text,opened", CASES)
def test_streamed_adds_up_to_the_whole_split_at_every_cut(name, text, opened):
    parser = REASONING_PARSERS[name]
    want = parser.split(text, opened)
    for cut in range(len(text) + 1):
        stream = ReasoningStream(parser, opened)
        got = [stream.feed(piece, final=k == 1) for k, piece in enumerate([text[:cut], text[cut:]])]
        assert ("".join(r for r, _ in got), "".join(a for _, a in got)) == want, cut
    stream = ReasoningStream(parser, opened)
    got = [stream.feed(ch, final=k == len(text) - 1) for k, ch in enumerate(text)]
    assert ("".join(r for r, _ in got), "".join(a for _, a in got)) == want


def client(tokenizer, script: str, parser: str, tool_parser: str | None = None) -> OpenAI:
    app = create_app(
        ScriptedBackend(tokenizer, script),
        tokenizer,
        model_name="m",
        max_model_len=2048,
        chat_template=QWEN_TOOLS_TEMPLATE,
        reasoning_parser=parser,
        tool_call_parser=tool_parser,
    )
    return OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0, http_client=TestClient(app))


@pytest.mark.parametrize(
    "parser,script,reasoning,content",
    [
        ("qwen3", "<think>\nLet me add.</think>\n\nIt is 4.", "\nLet me add.", "It is 4."),
        ("qwen3", "It is 4.", None, "It is 4."),  # no thinking block: all of it is the answer
        ("deepseek_r1", "Let me add.</think>\n\nIt is 4.", "Let me add.", "It is 4."),  # opened by the template
    ],
)
def test_chat_carries_reasoning_content_apart_streamed_and_not(tokenizer, parser, script, reasoning, content):
    c = client(tokenizer, script, parser)
    message = c.chat.completions.create(model="m", messages=ASK).choices[0].message
    assert message.content == content
    assert getattr(message, "reasoning_content", None) == reasoning
    chunks = list(c.chat.completions.create(model="m", messages=ASK, stream=True))
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert "".join(d.content or "" for d in deltas) == content
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == (reasoning or "")


def test_tool_calls_are_read_in_the_answer_only(tokenizer):
    script = (
        '<think>I could write <tool_call>{"name": "get_time"}</tool_call> here</think>\n\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    c = client(tokenizer, script, "qwen3", tool_parser="hermes")
    r = c.chat.completions.create(model="m", messages=ASK, tools=TOOLS)  # type: ignore[arg-type]
    message = r.choices[0].message
    assert [t.function.name for t in message.tool_calls or []] == ["get_weather"]
    assert "get_time" in getattr(message, "reasoning_content", "") and r.choices[0].finish_reason == "tool_calls"
    content, calls, finish, _ = streamed(c, messages=ASK, tools=TOOLS)
    assert [t["name"] for t in calls] == ["get_weather"] and finish == "tool_calls" and content == ""


def test_serve_and_gateway_offer_the_flag():
    import argparse

    from pdserve.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for role in ("serve", "gateway"):
        flag = next(a for a in sub.choices[role]._actions if a.dest == "reasoning_parser")
        assert flag.default is None and set(flag.choices or ()) == set(REASONING_PARSERS)


THINKING = "<think>\nLet me add.</think>\n\nIt is 4."


def test_responses_answer_reasoning_as_an_item(tokenizer):
    c = client(tokenizer, THINKING, "qwen3")
    r = c.responses.create(model="m", input="2 + 2?")
    assert [i.type for i in r.output] == ["reasoning", "message"] and r.output_text == "It is 4."
    assert r.output[0].content[0].text == "\nLet me add."  # type: ignore[union-attr,index]
    events = list(c.responses.create(model="m", input="2 + 2?", stream=True))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")  # type: ignore[union-attr]
    said = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert (thought, said) == ("\nLet me add.", "It is 4.")
    final = events[-1].response  # type: ignore[union-attr]
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == "It is 4."


def test_messages_answer_reasoning_as_a_thinking_block(tokenizer):
    import anthropic

    app = create_app(
        ScriptedBackend(tokenizer, THINKING), tokenizer, model_name="m", max_model_len=2048, reasoning_parser="qwen3"
    )
    claude = anthropic.Anthropic(base_url="http://testserver", api_key="x", max_retries=0, http_client=TestClient(app))
    ask = [{"role": "user", "content": "2 + 2?"}]
    m = claude.messages.create(
        model="m", max_tokens=50, messages=ask, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in m.content] == [
        ("thinking", "\nLet me add."),
        ("text", "It is 4."),
    ]
    with claude.messages.stream(model="m", max_tokens=50, messages=ask) as stream:
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text"] and final.content[1].text == "It is 4."  # type: ignore[union-attr]
    assert final.content[0].thinking == "\nLet me add."  # type: ignore[union-attr]


def test_messages_stream_text_after_a_call_in_its_own_block(tokenizer):
    import anthropic

    script = 'Checking.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\nDone.'
    app = create_app(
        ScriptedBackend(tokenizer, script),
        tokenizer,
        model_name="m",
        max_model_len=2048,
        chat_template=QWEN_TOOLS_TEMPLATE,
        tool_call_parser="hermes",
    )
    claude = anthropic.Anthropic(base_url="http://testserver", api_key="x", max_retries=0, http_client=TestClient(app))
    tool = {"name": "get_time", "input_schema": {"type": "object", "properties": {}}}
    kw = dict(model="m", max_tokens=80, messages=[{"role": "user", "content": "time?"}], tools=[tool])
    m = claude.messages.create(**kw)  # type: ignore[arg-type]
    with claude.messages.stream(**kw) as stream:  # type: ignore[arg-type]
        final = stream.get_final_message()
    assert [b.type for b in final.content] == ["text", "tool_use", "text"]
    assert "".join(b.text for b in final.content if b.type == "text") == m.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == m.stop_reason == "tool_use"
