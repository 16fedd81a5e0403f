"""--tool-call-parser's choices (vLLM's names) -> their parser."""

from __future__ import annotations

from pdserve.gateway.tools.hermes import HermesParser
from pdserve.gateway.tools.llama3_json import Llama3JsonParser
from pdserve.gateway.tools.mistral import MistralParser
from pdserve.gateway.tools.parser import ToolParser
from pdserve.gateway.tools.pythonic import PythonicParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, PythonicParser)
}


def tool_parser(name: str) -> ToolParser:
    """The parser named `name`; ValueError naming the choices otherwise."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser '{name}' (choices: {', '.join(PARSERS)})")
    return PARSERS[name]()
