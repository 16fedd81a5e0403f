"""JSON schemas of the shapes applications send with response_format and tools, for timing
schema compilation (bench/structured_output.py). Written after common API shapes (function
parameters, extraction, classification, records with nested arrays, unions, $ref recursion,
formats, bounds); none is downloaded (no network here)."""

from __future__ import annotations

from typing import Any

_STR: dict[str, Any] = {"type": "string"}
_INT: dict[str, Any] = {"type": "integer"}
_NUM: dict[str, Any] = {"type": "number"}
_BOOL: dict[str, Any] = {"type": "boolean"}


def _obj(required: list[str], closed: bool = True, **props: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props, "required": required}
    if closed:
        out["additionalProperties"] = False
    return out


REAL_WORLD_SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("tool: get_weather", _obj(["location"], location=_STR, unit={"enum": ["celsius", "fahrenheit"]})),
    (
        "tool: web_search",
        _obj(
            ["query"],
            query={"type": "string", "minLength": 1, "maxLength": 200},
            max_results={"type": "integer", "minimum": 1, "maximum": 20},
            recency_days={"type": ["integer", "null"]},
        ),
    ),
    (
        "tool: create_calendar_event",
        _obj(
            ["title", "start", "end"],
            title=_STR,
            start={"type": "string", "format": "date-time"},
            end={"type": "string", "format": "date-time"},
            attendees={"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 50},
            location=_STR,
            reminder_minutes={"type": "integer", "enum": [0, 5, 10, 30, 60]},
        ),
    ),
    (
        "tool: sql_query",
        _obj(
            ["table", "columns"],
            table={"type": "string", "pattern": "^[a-z_][a-z0-9_]*$"},
            columns={"type": "array", "items": _STR, "minItems": 1},
            where={
                "type": "array",
                "items": _obj(
                    ["column", "op", "value"],
                    column=_STR,
                    op={"enum": ["=", "!=", "<", "<=", ">", ">=", "like", "in"]},
                    value={"anyOf": [_STR, _NUM, _BOOL, {"type": "array", "items": _STR}]},
                ),
            },
            limit={"type": "integer", "minimum": 1, "maximum": 1000},
        ),
    ),
    (
        "sentiment",
        _obj(
            ["label", "confidence"],
            label={"enum": ["positive", "negative", "neutral", "mixed"]},
            confidence={"type": "number", "minimum": 0, "maximum": 1},
        ),
    ),
    (
        "named entities",
        _obj(
            ["entities"],
            entities={
                "type": "array",
                "items": _obj(
                    ["text", "type", "start", "end"],
                    text=_STR,
                    type={"enum": ["PERSON", "ORG", "LOC", "DATE", "MONEY", "PRODUCT", "EVENT"]},
                    start={"type": "integer", "minimum": 0},
                    end={"type": "integer", "minimum": 0},
                ),
            },
        ),
    ),
    (
        "invoice",
        _obj(
            ["invoice_number", "date", "currency", "lines", "total"],
            invoice_number={"type": "string", "pattern": "^INV-[0-9]{4,8}$"},
            date={"type": "string", "format": "date"},
            currency={"enum": ["USD", "EUR", "GBP", "JPY", "CHF"]},
            seller=_obj(["name"], name=_STR, vat_id={"type": ["string", "null"]}),
            lines={
                "type": "array",
                "minItems": 1,
                "items": _obj(
                    ["description", "quantity", "unit_price"],
                    description=_STR,
                    quantity={"type": "integer", "minimum": 1},
                    unit_price={"type": "number", "minimum": 0},
                    tax_rate={"type": "number", "minimum": 0, "maximum": 0.5},
                ),
            },
            total={"type": "number", "minimum": 0},
        ),
    ),
    (
        "user profile",
        _obj(
            ["id", "email", "name"],
            id={"type": "string", "format": "uuid"},
            email={"type": "string", "format": "email"},
            name=_obj(["first", "last"], first=_STR, last=_STR),
            birthday={"type": ["string", "null"], "format": "date"},
            website={"type": "string", "format": "uri"},
            roles={
                "type": "array",
                "items": {"enum": ["admin", "editor", "viewer"]},
            },  # (uniqueItems: llguidance refuses it, a 400)
            settings=_obj([], closed=False, theme={"enum": ["light", "dark"]}, notifications=_BOOL),
        ),
    ),
    (
        "postal address",
        _obj(
            ["street", "city", "country"],
            street=_STR,
            city=_STR,
            postal_code={"type": "string", "pattern": "^[A-Z0-9 -]{3,10}$"},
            country={"type": "string", "pattern": "^[A-Z]{2}$"},
            geo=_obj(
                ["lat", "lon"],
                lat={"type": "number", "minimum": -90, "maximum": 90},
                lon={"type": "number", "minimum": -180, "maximum": 180},
            ),
        ),
    ),
    (
        "product catalog page",
        _obj(
            ["items", "page"],
            items={
                "type": "array",
                "maxItems": 20,
                "items": _obj(
                    ["sku", "title", "price", "in_stock"],
                    sku={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
                    title={"type": "string", "maxLength": 120},
                    price=_obj(["amount", "currency"], amount={"type": "number", "minimum": 0}, currency=_STR),
                    in_stock=_BOOL,
                    tags={"type": "array", "items": _STR, "maxItems": 8},
                    variants={
                        "type": "array",
                        "items": _obj(["name"], name=_STR, size={"enum": ["XS", "S", "M", "L", "XL"]}),
                    },
                ),
            },
            page=_obj(["number", "size", "total"], number=_INT, size=_INT, total=_INT),
        ),
    ),
    (
        "github issue",
        _obj(
            ["title", "body", "labels"],
            title={"type": "string", "minLength": 5, "maxLength": 256},
            body=_STR,
            labels={"type": "array", "items": {"enum": ["bug", "enhancement", "docs", "question", "perf"]}},
            assignees={"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z0-9-]{1,39}$"}},
            milestone={"type": ["integer", "null"]},
            priority={"enum": ["P0", "P1", "P2", "P3"]},
        ),
    ),
    (
        "container spec",
        _obj(
            ["name", "image"],
            name={"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
            image=_STR,
            args={"type": "array", "items": _STR},
            env={"type": "array", "items": _obj(["name", "value"], name=_STR, value=_STR)},
            ports={
                "type": "array",
                "items": _obj(
                    ["containerPort"],
                    containerPort={"type": "integer", "minimum": 1, "maximum": 65535},
                    protocol={"enum": ["TCP", "UDP", "SCTP"]},
                ),
            },
            resources=_obj(
                [],
                limits=_obj([], cpu=_STR, memory=_STR),
                requests=_obj([], cpu=_STR, memory=_STR),
            ),
        ),
    ),
    (
        "chat moderation",
        _obj(
            ["flagged", "categories"],
            flagged=_BOOL,
            categories=_obj(
                ["hate", "harassment", "self_harm", "sexual", "violence"],
                hate=_BOOL,
                harassment=_BOOL,
                self_harm=_BOOL,
                sexual=_BOOL,
                violence=_BOOL,
            ),
            rationale={"type": "string", "maxLength": 500},
        ),
    ),
    (
        "union: payment method",
        {
            "oneOf": [
                _obj(
                    ["type", "card_number", "expiry"],
                    type={"const": "card"},
                    card_number={"type": "string", "pattern": "^[0-9]{16}$"},
                    expiry={"type": "string", "pattern": "^(0[1-9]|1[0-2])/[0-9]{2}$"},
                ),  # noqa: E501
                _obj(
                    ["type", "iban"],
                    type={"const": "sepa"},
                    iban={"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{11,30}$"},
                ),  # noqa: E501
                _obj(["type", "email"], type={"const": "paypal"}, email={"type": "string", "format": "email"}),
            ]
        },
    ),
    (
        "recursive: comment thread",
        {
            "$defs": {
                "comment": _obj(
                    ["author", "text", "replies"],
                    author=_STR,
                    text=_STR,
                    replies={"type": "array", "items": {"$ref": "#/$defs/comment"}},
                )
            },
            "$ref": "#/$defs/comment",
        },
    ),
    (
        "recursive: file tree",
        {
            "$defs": {
                "node": {
                    "anyOf": [
                        _obj(["file", "size"], file=_STR, size={"type": "integer", "minimum": 0}),
                        _obj(
                            ["dir", "children"], dir=_STR, children={"type": "array", "items": {"$ref": "#/$defs/node"}}
                        ),
                    ]
                }
            },
            "$ref": "#/$defs/node",
        },
    ),
    (
        "log event",
        _obj(
            ["timestamp", "level", "message"],
            timestamp={"type": "string", "format": "date-time"},
            level={"enum": ["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]},
            message=_STR,
            service=_STR,
            trace_id={"type": "string", "pattern": "^[0-9a-f]{32}$"},
            attributes={"type": "object", "additionalProperties": {"type": ["string", "number", "boolean"]}},
        ),
    ),
    (
        "meeting notes",
        _obj(
            ["summary", "decisions", "action_items"],
            summary={"type": "string", "maxLength": 1000},
            decisions={"type": "array", "items": _STR},
            action_items={
                "type": "array",
                "items": _obj(
                    ["owner", "task"],
                    owner=_STR,
                    task=_STR,
                    due={"type": ["string", "null"], "format": "date"},
                ),
            },
        ),
    ),
    (
        "recipe",
        _obj(
            ["name", "servings", "ingredients", "steps"],
            name=_STR,
            servings={"type": "integer", "minimum": 1, "maximum": 24},
            ingredients={
                "type": "array",
                "items": _obj(
                    ["item", "amount", "unit"],
                    item=_STR,
                    amount={"type": "number", "exclusiveMinimum": 0},
                    unit={"enum": ["g", "kg", "ml", "l", "tsp", "tbsp", "cup", "piece"]},
                ),
            },
            steps={"type": "array", "items": _STR, "minItems": 1},
            tags={"type": "array", "items": _STR},
        ),
    ),
    (
        "tuple: bounding boxes",
        _obj(
            ["boxes"],
            boxes={
                "type": "array",
                "items": {
                    "type": "array",
                    "prefixItems": [_STR, _NUM, _NUM, _NUM, _NUM],
                    "minItems": 5,
                    "maxItems": 5,
                },
            },
        ),
    ),
    (
        "paginated API response",
        _obj(
            ["data", "has_more"],
            data={
                "type": "array",
                "items": _obj(
                    ["id", "object", "created"],
                    id={"type": "string", "pattern": "^[a-z]+_[A-Za-z0-9]{8,24}$"},
                    object={"const": "item"},
                    created={"type": "integer", "minimum": 0},
                    metadata={"type": "object", "additionalProperties": _STR},
                ),
            },
            has_more=_BOOL,
            next_cursor={"type": ["string", "null"]},
        ),
    ),
    (
        "translation batch",
        _obj(
            ["source_language", "translations"],
            source_language={"type": "string", "pattern": "^[a-z]{2}(-[A-Z]{2})?$"},
            translations={
                "type": "array",
                "items": _obj(
                    ["language", "text"], language={"type": "string", "pattern": "^[a-z]{2}(-[A-Z]{2})?$"}, text=_STR
                ),
                "minItems": 1,
                "maxItems": 10,
            },
        ),
    ),
]
