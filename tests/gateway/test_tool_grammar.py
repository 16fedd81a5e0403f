"""The grammar forcing a call (tool_choice required or a named function), per parser format:
random walks through it on a real tokenizer (each step a random token among those it allows,
as a random-weight model samples) always parse, with that parser, into calls of the allowed
functions whose arguments validate against their schemas; what breaks the schema is refused."""

from __future__ import annotations

import json
import random

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

from pdserve.gateway.tools.constraint import tool_constraint
from pdserve.gateway.tools.json_list import FORCED_JSON
from pdserve.gateway.tools.registry import PARSERS, tool_parser
from pdserve.gateway.tools.request import Function, ToolRequest

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3},
        "where": {
            "type": "object",
            "properties": {"lat": {"type": "integer", "minimum": -90, "maximum": 90}, "exact": {"type": "boolean"}},
            "required": ["lat"],
            "additionalProperties": False,
        },
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
FUNCTIONS = [Function("get_weather", "the weather", WEATHER), Function("get_time", None, TIME)]
SCHEMAS = {f.name: f.parameters for f in FUNCTIONS}


@pytest.fixture(scope="module")
def llg_tokenizer(tokenizer):
    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))


def _walk(matcher: llguidance.LLMatcher, rng: random.Random, vocab: int, eos: int) -> list[int]:
    """Tokens drawn at random among those the grammar allows, until it ends (EOS taken at
    even odds once allowed)."""
    mask = allocate_token_bitmask(1, vocab)
    bits = torch.arange(32, dtype=torch.int32)
    ids: list[int] = []
    while not matcher.is_stopped():
        assert len(ids) < 2000, "the walk did not end"
        fill_next_token_bitmask(matcher, mask, 0)
        allowed = ((mask[0].unsqueeze(-1) >> bits) & 1).flatten()[:vocab].nonzero().flatten().tolist()
        token = eos if eos in allowed and rng.random() < 0.5 else rng.choice(allowed)
        assert matcher.consume_token(token), matcher.get_error()
        if token == eos:
            break
        ids.append(token)
    return ids


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("choice", ["required", "get_weather"])
@pytest.mark.parametrize("name", [*sorted(PARSERS), "json_list"])  # json_list: forced without a parser
def test_every_walk_parses_into_valid_calls(tokenizer, llg_tokenizer, name, choice, parallel):
    parser = FORCED_JSON if name == "json_list" else tool_parser(name)
    constraint = tool_constraint(ToolRequest(FUNCTIONS, choice, parallel), parser, None)
    assert constraint is not None and constraint.kind == "lark"
    allowed_names = {"get_weather", "get_time"} if choice == "required" else {choice}
    rng = random.Random(f"{name}-{choice}-{parallel}")
    counts = set()
    for _ in range(12):
        matcher = llguidance.LLMatcher(llg_tokenizer, constraint.spec, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        text = tokenizer.decode(_walk(matcher, rng, len(tokenizer), tokenizer.eos_token_id))
        parsed = parser.parse(text)
        assert parsed.content == "" and parsed.calls, text
        counts.add(len(parsed.calls))
        for call in parsed.calls:
            assert call.name in allowed_names, text
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    if parallel and choice == "required":  # one call or several (a named function: exactly one)
        assert max(counts) > 1, counts
    else:
        assert counts == {1}


@pytest.mark.parametrize("name", [*sorted(PARSERS), "json_list"])  # json_list: forced without a parser
def test_a_call_outside_the_schema_is_refused(tokenizer, llg_tokenizer, name):
    parser = FORCED_JSON if name == "json_list" else tool_parser(name)
    constraint = tool_constraint(ToolRequest(FUNCTIONS, "get_time", False), parser, None)
    assert constraint is not None
    good = {
        "hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone":"utc"}}\n</tool_call>',
        "llama3_json": '{"name": "get_time", "parameters": {"zone":"utc"}}',
        "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone":"utc"}}]',
        "pythonic": '[get_time(zone="utc")]',
        "json_list": '[{"name": "get_time", "parameters": {"zone":"utc"}}]',
    }[name]

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(llg_tokenizer, constraint.spec, log_level=0)
        return all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False)) and (
            matcher.is_accepting()
        )

    assert accepts(good)
    assert parser.parse(good).calls[0].name == "get_time"
    assert not accepts(good.replace("utc", "pst"))  # not in the enum
    assert not accepts(good.replace("get_time", "get_weather"))  # not the named function
