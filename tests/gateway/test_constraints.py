"""Output constraints at the gateway: every accepted form becomes one StructuredOutput, and a bad
schema, regex or grammar is a 400 naming its field before any work (llguidance, no torch)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.gateway.bodies import Bounds
from pdserve.gateway.errors import APIError
from pdserve.gateway.limits import GatewayLimits
from pdserve.gateway.schemas import parse_request
from pdserve.protocol.sampling import StructuredOutput

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["a"]}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


def parse(extra: dict, kind: str = "chat"):
    body = {**CHAT, **extra} if kind == "chat" else {"prompt": "hi", **extra}
    bounds = Bounds.of(GatewayLimits(), model_name="m", max_model_len=4096, vocab_size=512)
    return parse_request(body, kind, bounds)  # type: ignore[arg-type]


def refused(extra: dict, kind: str = "chat") -> APIError:
    with pytest.raises(APIError) as e:
        parse(extra, kind)
    assert e.value.status == 400
    return e.value


JSON_SPEC = json.dumps(SCHEMA, separators=(",", ":"))


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize(
    "extra,want",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object", "")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutput("json_schema", JSON_SPEC),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json_schema", JSON_SPEC)),
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutput("regex", "[0-9]+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutput("choice", '["a", "b"]')),
        ({"structured_outputs": {"grammar": 'start: "x"+'}}, StructuredOutput("grammar", 'start: "x"+')),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object", "")),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutput("json_schema", JSON_SPEC)),
        ({"guided_regex": "a|b"}, StructuredOutput("regex", "a|b")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", '["yes", "no"]')),
        ({"guided_grammar": 'root ::= "yes" | "no"'}, StructuredOutput("grammar", 'root ::= "yes" | "no"')),
    ],
)
def test_every_form_becomes_one_constraint(extra, want, kind):
    assert parse(extra, kind).structured == want


@pytest.mark.parametrize(
    "extra,param,words",
    [
        ({"guided_regex": "[a-"}, "guided_regex", "unclosed character class"),
        ({"structured_outputs": {"json": {"type": "objectx"}}}, "structured_outputs", "objectx"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_grammar": "start: foo"}, "guided_grammar", "unknown name"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "'name' and a 'schema'"),
        ({"response_format": {"type": "xml"}}, "response_format", "text, json_object or json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}},
            "response_format",
            "object",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "structural_tag"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "at most one"),
        ({"guided_regex": "a", "use_beam_search": True, "n": 2, "temperature": 0}, "use_beam_search", "beam search"),
        ({"tools": [{"type": "function"}]}, "tools", "tools[0]"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it(extra, param, words):
    e = refused(extra)
    assert e.param == param and words in e.message, e.message


def test_the_gateway_validates_without_torch():
    code = (
        "import sys; from pdserve.gateway.constraints import parse_constraint;"
        "parse_constraint({'guided_json': {'type': 'object'}}); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
