"""Tool-call parsers (gateway/tools/): each family's output read whole, and streamed in pieces
cut at every character (so markup split across token boundaries at every byte): the deltas add
up to the whole parse, content deltas never carry markup, and a call is announced once."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.gateway.tools.json_list import FORCED_JSON
from pdserve.gateway.tools.parser import ToolParser
from pdserve.gateway.tools.registry import PARSERS, tool_parser
from pdserve.gateway.tools.stream import ToolCallStream, message_calls

WEATHER = {"city": "Paris", "days": [1, {"x": "}]"}], "note": 'a "quoted" { brace'}
CASES: dict[str, list[tuple[str, str, list[tuple[str, dict]]]]] = {
    "hermes": [
        ("Just text, no call. 3 < 4 <tool", "Just text, no call. 3 < 4 <tool", []),
        (
            'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": '
            + json.dumps(WEATHER)
            + "}\n</tool_call>",
            "Let me look.",
            [("get_weather", WEATHER)],
        ),
        (
            '<tool_call>\n{"name": "a", "arguments": {"é": "ü"}}\n</tool_call>\n<tool_call>\n'
            '{"arguments": {}, "name": "b"}\n</tool_call>\nDone.',
            "Done.",
            [("a", {"é": "ü"}), ("b", {})],
        ),
        ("<tool_call>\nnot json\n</tool_call> after", "<tool_call>\nnot json\n</tool_call> after", []),
        ('<tool_call>\n{"name": "c"}\n</tool_call>', "", [("c", {})]),
    ],
    "llama3_json": [
        ("The answer is 4.", "The answer is 4.", []),
        ('{"answer": 4}', '{"answer": 4}', []),
        (
            '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}",
            "",
            [("get_weather", WEATHER)],
        ),
        ('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "", [("a", {"x": 1}), ("b", {})]),
        ('{"name": "a", "arguments": {"x": [1, 2]}} and more', "and more", [("a", {"x": [1, 2]})]),
    ],
    "mistral": [
        ("No tools [TOOL", "No tools [TOOL", []),
        (
            'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}]",
            "Sure.",
            [("get_weather", WEATHER)],
        ),
        (
            '[TOOL_CALLS] [{"name": "a", "arguments": {"k": null}}, {"name": "b", "arguments": {"k": false}}]',
            "",
            [("a", {"k": None}), ("b", {"k": False})],
        ),
        ("[TOOL_CALLS] oops", "[TOOL_CALLS] oops", []),
    ],
    "pythonic": [
        ("Plain [answer]", "Plain [answer]", []),
        ("[1, 2, 3]", "[1, 2, 3]", []),
        (
            '[get_weather(city="Paris", days=[1, {"x": "}]"}])]',
            "",
            [("get_weather", {"city": "Paris", "days": [1, {"x": "}]"}]})],
        ),
        (
            "[a(x=1, y='two)'), b(flag=True, none=None, j=true)]",
            "",
            [("a", {"x": 1, "y": "two)"}), ("b", {"flag": True, "none": None, "j": True})],
        ),
        ("[a(1)]", "[a(1)]", []),
    ],
    # calls forced without --tool-call-parser (gateway/tools/json_list.py)
    "json_list": [
        ('[{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}]", "", [("get_weather", WEATHER)]),
        ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]', "", [("a", {"x": 1}), ("b", {})]),
    ],
}


def parser_named(name: str) -> ToolParser:
    return FORCED_JSON if name == "json_list" else tool_parser(name)


def _cases():
    return [
        pytest.param(name, *case, id=f"{name}-{i}") for name, cases in CASES.items() for i, case in enumerate(cases)
    ]


def _accumulate(pieces: list[str], name: str) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Feed `pieces` to a stream; (content, [(name, arguments)], each content delta)."""
    stream = ToolCallStream(parser_named(name))
    content, deltas, calls = "", [], {}
    for k, piece in enumerate(pieces):
        delta, entries = stream.feed(piece, final=k == len(pieces) - 1)
        content += delta
        deltas.append(delta)
        for e in entries:
            if "id" in e:  # the first entry of a call: index, id, type, name, empty arguments
                assert e["index"] not in calls and e["type"] == "function" and e["id"].startswith("call_")
                assert e["function"]["arguments"] == ""
                calls[e["index"]] = [e["function"]["name"], ""]
            else:
                assert set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
                calls[e["index"]][1] += e["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [(n, a) for n, a in (calls[i] for i in sorted(calls))], deltas


@pytest.mark.parametrize("name,text,content,calls", _cases())
def test_whole_output(name, text, content, calls):
    parsed = parser_named(name).parse(text)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    message = message_calls(parsed)
    assert [m["function"]["name"] for m in message] == [n for n, _ in calls]
    assert all(m["type"] == "function" and m["id"].startswith("call_") for m in message)


@pytest.mark.parametrize("name,text,content,calls", _cases())
def test_streamed_equals_whole_at_every_cut(name, text, content, calls):
    whole = parser_named(name).parse(text)
    want = (whole.content, [(c.name, c.arguments) for c in whole.calls])
    markers = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>")
    for cut in range(len(text) + 1):  # two pieces, cut at every character
        got_content, got_calls, _ = _accumulate([text[:cut], text[cut:]], name)
        assert (got_content, got_calls) == want, cut
    got_content, got_calls, deltas = _accumulate(list(text), name)  # one character at a time
    assert (got_content, got_calls) == want
    if calls:  # no markup leaks out as content, in any piece
        assert not any(m in got_content for m in markers)
    rng = random.Random(0)
    for _ in range(20):  # random token-like cuts
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert _accumulate(pieces, name)[:2] == want


def test_each_parser_is_registered_under_vllms_name():
    assert set(PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_parser("nope")


def test_serve_and_gateway_offer_every_parser():
    import argparse

    from pdserve.cli.main import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for role in ("serve", "gateway"):
        flag = next(a for a in sub.choices[role]._actions if a.dest == "tool_call_parser")
        assert flag.default is None and set(flag.choices or ()) == set(PARSERS)
