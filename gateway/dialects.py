"""How each generating endpoint reads its body and writes its answer. Every endpoint maps its body
onto the one internal request (gateway/schemas.py `ParsedRequest`) and runs it the same way
(gateway/app.py `GatewayApp.handle`, gateway/generation.py `GenerationRun`); only the shapes
differ: OpenAI's completions and chat here, Anthropic's Messages (gateway/anthropic.py) and
OpenAI's Responses (gateway/responses.py)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from pdserve.gateway.bodies import Bounds
from pdserve.gateway.errors import APIError
from pdserve.gateway.generation import GenerationRun
from pdserve.gateway.schemas import ParsedRequest, RequestKind, parse_request
from pdserve.gateway.tools.parser import ToolParser


class Dialect:
    """OpenAI's /v1/completions or /v1/chat/completions (`kind`)."""

    def __init__(self, kind: RequestKind) -> None:
        self.kind = kind
        self.id_prefix = "chatcmpl-" if kind == "chat" else "cmpl-"

    def parse(self, body: Any, bounds: Bounds, tool_parser: ToolParser | None) -> ParsedRequest:
        return parse_request(body, self.kind, bounds, tool_parser)

    def error(self, e: APIError) -> Response:
        return e.response()

    def sse(self, run: GenerationRun, first: Any) -> AsyncGenerator[bytes, None]:
        """The streamed answer; it closes the run however it ends."""
        return run.sse(first)

    async def respond(self, run: GenerationRun, first: Any, request: Request) -> Response:
        return await run.collect(first, request)


COMPLETIONS = Dialect("completion")
CHAT = Dialect("chat")
