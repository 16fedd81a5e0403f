"""A request's output constraint: OpenAI's `response_format`, vLLM's `structured_outputs` and
its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` -> one
StructuredOutput (protocol/sampling.py), checked here by the compiler the workers run
(engine/structured/grammar.py, llguidance, no torch), so a bad schema, regex or grammar is a 400
before any work leaves the gateway.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.engine.structured.grammar import check
from pdserve.gateway.errors import invalid
from pdserve.protocol.sampling import StructuredKind, StructuredOutput

GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
CONSTRAINT_FIELDS = {"response_format", "structured_outputs", *GUIDED}
JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def _spec(kind: StructuredKind, value: Any, param: str) -> StructuredOutput:
    """One constraint from its value: a schema (object, or its JSON text), a regex, a grammar
    (strings), a choice (a non-empty list of non-empty strings)."""
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise invalid(f"'{param}': the JSON schema is not valid JSON ({e})", param) from None
        if not isinstance(value, dict):
            raise invalid(f"'{param}' must be a JSON schema object", param)
        spec = json.dumps(value, separators=(",", ":"))  # key order kept: properties come in it
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid(f"'{param}' must be a non-empty list of non-empty strings", param)
        spec = json.dumps(value)
    else:
        if not isinstance(value, str) or not value:
            raise invalid(f"'{param}' must be a non-empty string", param)
        spec = value
    return StructuredOutput(kind, spec)


def _response_format(fmt: Any) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise invalid("'response_format' must be an object with a string 'type'", param)
    kind, extra = fmt["type"], sorted(set(fmt) - {"type", "json_schema"})
    if extra or (kind != "json_schema" and "json_schema" in fmt):
        raise invalid(f"'response_format': unexpected field '{(extra or ['json_schema'])[0]}'", param)
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object", "")
    if kind != "json_schema":
        raise invalid("'response_format.type' must be text, json_object or json_schema", param)
    js = fmt.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("name"), str) or "schema" not in js:
        raise invalid("'response_format.json_schema' must be an object with a 'name' and a 'schema'", param)
    if set(js) - JSON_SCHEMA_KEYS:
        raise invalid(
            f"'response_format.json_schema': unexpected field '{sorted(set(js) - JSON_SCHEMA_KEYS)[0]}'", param
        )
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise invalid("'response_format.json_schema.strict' must be a boolean", param)
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise invalid("'response_format.json_schema.description' must be a string", param)
    if not isinstance(js["schema"], dict):
        raise invalid("'response_format.json_schema.schema' must be a JSON schema object", param)
    return _spec("json_schema", js["schema"], param)  # strict or not, the schema is enforced


def _structured_outputs(value: Any) -> StructuredOutput:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid("'structured_outputs' must be an object", param)
    given = {k: v for k, v in value.items() if v is not None}
    unknown = sorted(set(given) - set(STRUCTURED_OUTPUTS) - {"json_object"})
    if unknown:
        raise invalid(f"'structured_outputs.{unknown[0]}' is not supported", param)
    if given.get("json_object") is False:
        del given["json_object"]
    if len(given) != 1:
        raise invalid("'structured_outputs' takes exactly one of json, regex, choice, grammar, json_object", param)
    ((key, v),) = given.items()
    if key == "json_object":
        if v is not True:
            raise invalid("'structured_outputs.json_object' must be a boolean", param)
        return StructuredOutput("json_object", "")
    return _spec(STRUCTURED_OUTPUTS[key], v, param)  # type: ignore[arg-type]


def parse_constraint(body: dict) -> StructuredOutput | None:
    """The request's constraint (at most one of the fields), compiled once to check it: 400
    naming the field and what the compiler found wrong."""
    found: list[tuple[str, StructuredOutput | None]] = []
    if body.get("response_format") is not None:
        found.append(("response_format", _response_format(body["response_format"])))
    if body.get("structured_outputs") is not None:
        found.append(("structured_outputs", _structured_outputs(body["structured_outputs"])))
    for key, kind in GUIDED.items():
        if body.get(key) is not None:
            found.append((key, _spec(kind, body[key], key)))  # type: ignore[arg-type]
    found = [(k, c) for k, c in found if c is not None]
    if len(found) > 1:
        raise invalid(f"'{found[0][0]}' and '{found[1][0]}': give at most one output constraint", found[1][0])
    if not found:
        return None
    param, constraint = found[0]
    assert constraint is not None
    try:
        check(constraint)
    except Exception as e:  # noqa: BLE001 - the compiler's word, whatever it raised, is the 400
        raise invalid(f"'{param}': {e}", param) from None
    return constraint
