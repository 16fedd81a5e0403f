"""OpenAI-compatible HTTP API over a `Backend`: the HTTP side (body limits, validation through
gateway/schemas.py, tokenization, status codes, the API key, routes). Each accepted request
becomes a gateway/generation.py `GenerationRun` (n-way fan-out, detokenization, stop strings,
SSE or JSON), shaped by gateway/formats.py for its endpoint. Besides the OpenAI routes:
`GET /v1/workers` (the cluster's members and their load), `POST /cluster/join` (a worker joining
by this URL, signed with the cluster secret: protocol/join.py), /health (ready: a prefill/decode
pair or a colocated worker is live), /health/live (the process answers), /metrics.

Readiness is one notion (`Backend.health`, as vLLM's server has it): while the gateway is not
ready, /health, /v1/models and every generation request answer 503 with the OpenAI error envelope
(`code: "not_ready"`, Retry-After), so a client that waits for /v1/models to answer is never then
refused for want of workers.

API keys are tenants (gateway/tenants.py): the bearer key names one, whose limits
(gateway/rate_limits.py) are checked once the request's tokens are known and before any work
reaches a worker (429 with Retry-After and OpenAI's x-ratelimit headers; a max_tokens over the
key's cap: 400); its priority orders the admission queue (gateway/admission.py).

Request ids are made here (`cmpl-...`/`chatcmpl-...`), never taken from the client. Leaving a
request early for any reason (client gone, stop string, error) closes its backend stream,
which aborts the request on every worker holding it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Callable

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.engine.structured.grammar import after_reasoning
from pdserve.gateway.anthropic import MESSAGES, anthropic_error, count_tokens
from pdserve.gateway.backend import Backend
from pdserve.gateway.bodies import Bounds, DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, decode
from pdserve.gateway.dialects import CHAT, COMPLETIONS, Dialect
from pdserve.gateway.errors import APIError, error_response, invalid
from pdserve.gateway.generation import GenerationRun, RunContext
from pdserve.gateway.limits import GatewayLimits
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openapi import openapi_endpoint
from pdserve.gateway.rate_limits import Admission, RateLimited, RequestOverLimit, TenantGate
from pdserve.gateway.reasoning import REASONING_PARSERS, ReasoningParser, marker_lark
from pdserve.gateway.responses import RESPONSES
from pdserve.gateway.schemas import ParsedRequest, chat_messages
from pdserve.gateway.tenants import TenantDirectory
from pdserve.gateway.text_decoder import special_markers, text_decoder
from pdserve.gateway.tools.parser import ToolParser
from pdserve.gateway.tools.registry import tool_parser
from pdserve.gateway.tools.request import ToolRequest, parse_tools
from pdserve.protocol.join import JOIN_PATH, JoinRefused
from pdserve.protocol.sampling import SamplingParams, StructuredOutput

log = logging.getLogger(__name__)

MAX_JOIN_BYTES = 4096
KEYED_PATHS = ("/tokenize", "/detokenize")  # besides /v1/*: what needs the API key when the server has one
TENANT_SCOPE_KEY = "pdserve.tenant"  # where _ApiKeyMiddleware leaves the request's TenantGate


class _EventStream(StreamingResponse):
    """An SSE response that closes its event generator and its run however the response ends: a
    client gone mid-write (or cut by gateway/slow_clients.py) would otherwise leave the generator
    suspended, its request still counted in flight (its API key's too) and open upstream, until
    garbage collection; one gone before the first write leaves the generator unstarted, whose own
    cleanup then never runs."""

    body_iterator: AsyncGenerator[bytes, None]  # the dialect's events (GenerationRun.sse() for OpenAI's)

    def __init__(self, run: GenerationRun, events: AsyncGenerator[bytes, None], headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await self.run.close()


class _ApiKeyMiddleware:
    """Pure ASGI: rejects /v1/* without a known bearer key before any body is read, and leaves
    the key's tenant in the scope."""

    def __init__(self, app, tenants: TenantDirectory) -> None:
        self.app, self.tenants = app, tenants

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and (scope["path"].startswith("/v1") or scope["path"] in KEYED_PATHS):
            headers = dict(scope.get("headers", []))
            key = headers.get(b"x-api-key")  # Anthropic's clients send the key so
            gate = self.tenants.lookup(headers.get(b"authorization", b"") if key is None else b"Bearer " + key)
            if gate is None:
                refusal = APIError(
                    401, "invalid or missing API key", type_="authentication_error", code="invalid_api_key"
                )
                resp = anthropic_error(refusal) if scope["path"].startswith("/v1/messages") else refusal.response()
                return await resp(scope, receive, send)
            scope[TENANT_SCOPE_KEY] = gate
        return await self.app(scope, receive, send)


class GatewayApp:
    def __init__(
        self,
        backend: Backend,
        tokenizer,
        model_name: str,
        max_model_len: int,
        limits: GatewayLimits,
        chat_template: str | None,
        tenants: TenantDirectory,
        tool_parser: ToolParser | None = None,
        reasoning: ReasoningParser | None = None,  # --reasoning-parser's (gateway/reasoning.py)
        unrendered: frozenset[int] = frozenset(),  # ids that stand for no text (engine/gguf_file.py)
    ) -> None:
        self.backend = backend
        self.tool_parser = tool_parser  # --tool-call-parser's (gateway/tools/)
        self.tool_markers = special_markers(tokenizer, tool_parser.markers if tool_parser else ())
        # how an output grammar names the reasoning's markers (once: the tokenizer does not change)
        self.reasoning_lark = tuple(marker_lark(tokenizer, m) for m in reasoning.markers) if reasoning else None
        self.tenants = tenants
        self.tokenizer = tokenizer
        self.text_decoder = text_decoder(tokenizer)  # the detokenizers' decode (gateway/text_decoder.py)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.limits = limits
        self.chat_template = chat_template
        self.vocab_size = len(tokenizer)
        self.bounds = Bounds.of(limits, model_name=model_name, max_model_len=max_model_len, vocab_size=self.vocab_size)
        self.metrics = GatewayMetrics(
            backend.worker_stats, backend.routed_requests, backend.queue_stats, tuple(backend.collectors())
        )
        self.in_flight = 0
        self.run_context = RunContext(
            backend=backend,
            metrics=self.metrics,
            limits=limits,
            model_name=model_name,
            token_text=self._token_text,
            text_decoder=self.text_decoder,
            tool_parser=tool_parser,
            tool_markers=self.tool_markers,
            reasoning=reasoning,
            reasoning_markers=special_markers(tokenizer, reasoning.markers) if reasoning else {},
            unrendered=unrendered,
            on_cut=self.stream_cut,
            on_done=self._done,
        )

    # --- plumbing ---------------------------------------------------------------------------
    async def read_json(self, request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            raise APIError(413, f"request body over {self.limits.max_body_bytes} bytes", code="body_too_large")
        body = bytearray()
        chunks = request.stream().__aiter__()
        deadline = time.monotonic() + self.limits.body_read_timeout_s  # for the whole body: no dribbling
        while True:
            try:
                chunk = await asyncio.wait_for(chunks.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise APIError(
                    408,
                    f"request body not received within {self.limits.body_read_timeout_s:g} s",
                    code="body_timeout",
                    headers={"Connection": "close"},
                ) from None
            body += chunk
            if len(body) > self.limits.max_body_bytes:
                raise APIError(413, f"request body over {self.limits.max_body_bytes} bytes", code="body_too_large")
        try:
            return json.loads(body, parse_float=_json_number)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid(f"malformed JSON body: {e}") from None

    def _tokenize(self, req: ParsedRequest) -> list[int]:
        if req.prompt_ids is not None:
            if req.echo:  # echo repeats the prompt's text
                req.prompt_text = self.tokenizer.decode(req.prompt_ids)
            return req.prompt_ids
        if req.messages is not None:
            return self.chat_ids(req.messages, req.tools)
        return self.tokenizer.encode(req.prompt_text)

    def chat_ids(
        self,
        messages: list[dict],
        tools: ToolRequest | None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """A chat's prompt through the model's chat template (or --chat-template's)."""
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise invalid(
                "this model has no chat template: use /v1/completions, or start the server with --chat-template FILE",
                "messages",
            )
        entries = [f.template_entry() for f in tools.functions] if tools is not None else None
        extra = {"continue_final_message": True} if continue_final_message else {}
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=entries,
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **extra,
            )
        except Exception as e:  # noqa: BLE001 - the template's own refusal (raise_exception) is the client's
            raise invalid(f"the chat template refused these messages: {e}", "messages") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_model(self, model: str | None) -> None:
        """404 for a model this server does not serve (None: the served one)."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    # --- /tokenize and /detokenize (vLLM's shapes; the tokenizer only, no worker needed) ----
    async def tokenize(self, request: Request) -> Response:
        body = await self.read_json(request)
        if isinstance(body, dict) and "messages" in body:
            chat = decode(body, TokenizeChatRequest, self.bounds)
            self.check_model(chat.model)
            if chat.add_generation_prompt and chat.continue_final_message:
                raise invalid(
                    "'add_generation_prompt' and 'continue_final_message' cannot both be true",
                    "continue_final_message",
                )
            messages = chat_messages(body["messages"])
            tools = parse_tools({"tools": body.get("tools")})
            ids = await asyncio.to_thread(
                self.chat_ids,
                messages,
                tools,
                add_generation_prompt=chat.add_generation_prompt is not False and not chat.continue_final_message,
                continue_final_message=bool(chat.continue_final_message),
                add_special_tokens=bool(chat.add_special_tokens),
            )
            strs = chat.return_token_strs
        else:
            text = decode(body, TokenizeCompletionRequest, self.bounds)
            self.check_model(text.model)
            ids = await asyncio.to_thread(
                self.tokenizer.encode, text.prompt, add_special_tokens=text.add_special_tokens is not False
            )
            strs = text.return_token_strs
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": self.tokenizer.convert_ids_to_tokens(ids) if strs else None,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        body = decode(await self.read_json(request), DetokenizeRequest, self.bounds)
        self.check_model(body.model)
        return JSONResponse({"prompt": await asyncio.to_thread(self.tokenizer.decode, body.tokens)})

    def _constraint(self, req: ParsedRequest, prompt: list[int]) -> StructuredOutput | None:
        """The request's output constraint as the workers apply it: under --reasoning-parser it
        starts once the reasoning ends (engine/structured/grammar.py after_reasoning)."""
        thinking = self.run_context.reasoning
        if req.structured is None or thinking is None or self.reasoning_lark is None or not req.splits_reasoning:
            return req.structured
        start, end = self.reasoning_lark
        return after_reasoning(req.structured, thinking.prompt_opens(prompt, self._token_text), start, end)

    def _sampling(
        self, req: ParsedRequest, max_tokens: int, i: int, priority: int, structured: StructuredOutput | None
    ) -> SamplingParams:
        """Choice i's parameters (n independent requests), or, for a group (i = 0), the whole
        request's: its members draw with seed + member index (engine/sequence_group.py). A
        sampled group without a seed gets one here, so a migrated group replays exactly.
        `priority` (the request's, else its key's) travels with it: the pools order by it too."""
        seed = None if req.seed is None else (req.seed + i) % 2**63
        group: dict = {}
        if req.is_group:
            group = {
                "n": req.n,
                "best_of": req.best_of,
                "use_beam_search": req.use_beam_search,
                "length_penalty": req.length_penalty,
                "early_stopping": req.early_stopping,
            }
            if seed is None and not req.use_beam_search and req.temperature > 0:
                seed = secrets.randbits(63)
        given = req.sampling | {
            "min_tokens": min(req.sampling.get("min_tokens", 0), max_tokens),
            "temperature": 0.0 if req.use_beam_search else req.temperature,
            "seed": seed,
        }
        return SamplingParams(
            **(given | group),
            max_tokens=max_tokens,
            stop_token_ids=tuple(req.stop_token_ids),
            logprobs=req.logprobs,
            prompt_logprobs=req.prompt_top,
            logit_bias=tuple(req.logit_bias),
            structured=structured,
            priority=priority,
        )

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _max_tokens(self, req: ParsedRequest, prompt: list[int], gate: TenantGate) -> int:
        """The request's max_tokens: as asked (400 over the key's cap), else what the context
        leaves, at most the key's cap."""
        cap = gate.limits.max_tokens_per_request
        if req.max_tokens is None:
            rest = max(1, self.max_model_len - len(prompt))
            return rest if cap is None else min(rest, cap)
        if cap is not None and req.max_tokens > cap:
            raise APIError(
                400,
                f"max_tokens is {req.max_tokens}, over this API key's limit of {cap} (max_tokens_per_request)",
                param="max_tokens",
                code="max_tokens_over_key_limit",
            )
        return req.max_tokens

    def _admit(self, gate: TenantGate, req: ParsedRequest, prompt: list[int], max_tokens: int) -> Admission:
        """Charge the key's limits (prompt + max_tokens per sequence) or raise the 429 / 400."""
        try:
            return gate.admit(len(prompt) + max_tokens * req.num_seqs)
        except RateLimited as e:
            self.metrics.rate_limited.labels(key=gate.name, limit=e.kind).inc()
            raise APIError(
                429,
                str(e),
                type_="requests" if e.kind == "concurrency" else e.kind,
                code="rate_limit_exceeded",
                headers=e.headers,
            ) from None
        except RequestOverLimit as e:
            raise APIError(400, str(e), param="max_tokens", code="request_too_large") from None

    # --- one request --------------------------------------------------------------------------
    def not_ready(self) -> APIError | None:
        """The 503 every route answers while the backend is not ready (None: ready)."""
        ok, detail = self.backend.health()
        if ok:
            return None
        live = detail.get("live_workers", {})
        have = ", ".join(f"{n} {role}" for role, n in live.items()) or "none"
        return APIError(
            503,
            f"not ready: no live workers to serve requests (need a prefill and a decode worker, or a colocated "
            f"worker; live: {have})",
            type_="server_error",
            code="not_ready",
            headers={"Retry-After": "2"},
        )

    async def handle(self, request: Request, dialect: Dialect) -> Response:
        arrival = time.monotonic()
        gate: TenantGate = request.scope.get(TENANT_SCOPE_KEY) or self.tenants.anonymous
        try:
            refused = self.not_ready()
            if refused is not None:
                raise refused
            req = dialect.parse(await self.read_json(request), self.bounds, self.tool_parser)
            self.check_model(req.model)
            prompt = await asyncio.to_thread(self._tokenize, req)
            if not prompt:
                raise invalid("the prompt is empty after tokenization", "prompt")
            bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise invalid(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt")
            bad = next((t for t, _ in req.logit_bias if t >= self.vocab_size), None)
            if bad is not None:
                raise invalid(
                    f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab_size})", "logit_bias"
                )
            # (max_tokens 0 scores the prompt: one token is still computed to end its prefill, then dropped)
            max_tokens = max(1, self._max_tokens(req, prompt, gate))
            if len(prompt) + max_tokens > self.max_model_len:
                raise invalid(
                    f"this model's maximum context length is {self.max_model_len} tokens; the "
                    f"prompt has {len(prompt)} and max_tokens is {max_tokens} "
                    f"({len(prompt) + max_tokens} in total)",
                    "max_tokens",
                )
            admission = self._admit(gate, req, prompt, max_tokens)  # nothing awaits from here to the run
            if req.constraint_kind is not None:
                self.metrics.structured_requests.labels(kind=req.constraint_kind).inc()
                self.metrics.structured_compile.observe(req.constraint_check_s)
        except APIError as e:
            self.metrics.http_errors.labels(status=str(e.status)).inc()
            return dialect.error(e)
        base_id = dialect.id_prefix + uuid.uuid4().hex
        priority = req.priority if req.priority is not None else gate.limits.priority
        try:
            sampling = self._sampling(req, max_tokens, 0, priority, self._constraint(req, prompt))
            run = GenerationRun(
                self.run_context, req, prompt, sampling, base_id, arrival, request.headers.get("traceparent"), admission
            )
        except BaseException:
            admission.release(0)
            raise
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            first = await run.start()
        except BaseException:
            self._done(run)
            raise
        if isinstance(first, APIError):
            self._done(run)
            refusal = dialect.error(first)
            refusal.headers.update(admission.headers)
            return refusal
        if req.stream:
            events = dialect.sse(run, first)
            return _EventStream(run, events, headers={"Cache-Control": "no-cache", **admission.headers})
        try:
            response = await dialect.respond(run, first, request)
        finally:
            self._done(run)
        response.headers.update(admission.headers)
        return response

    def stream_cut(self, reason: str) -> None:
        self.metrics.streams_cut.labels(reason=reason).inc()
        if reason == "buffer_full":
            log.warning(
                "aborted a request whose client read too slowly (%d outputs waiting)", self.limits.max_stream_buffer
            )

    def header_deadline(self, outcome: str) -> None:
        self.metrics.header_deadlines.labels(outcome=outcome).inc()

    def _done(self, run: GenerationRun) -> None:
        """A request's end (once per run): in-flight counts down, its key gets back the tokens
        it did not use, and the key's usage is counted."""
        if run.admission.released:
            return
        completion = sum(c.num_tokens for c in run.choices)
        run.admission.release(len(run.prompt) + completion)
        self.in_flight -= 1
        self.metrics.in_flight.dec()
        self.metrics.observe_usage(run.admission.gate.name, len(run.prompt), completion)


def create_app(
    backend: Backend,
    tokenizer,
    *,
    model_name: str,
    max_model_len: int,
    limits: GatewayLimits | None = None,
    api_key: str | None = None,
    tenants: TenantDirectory | None = None,
    chat_template: str | None = None,
    model_root: str | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    unrendered_token_ids: frozenset[int] = frozenset(),
) -> Starlette:
    """`api_key`: one key (tenant `default`, no limits); `tenants`: the keys file's (which
    already holds `api_key`'s, TenantDirectory.build); neither: no key needed.
    `tool_call_parser`: how tool calls are read and forced (gateway/tools/registry.py; None:
    chat requests with tools get a 400 unless tool_choice is none). `unrendered_token_ids`: ids
    whose text is none (a GGUF file's UNUSED tokens: engine/gguf_file.py unrendered_token_ids)."""
    if tenants is None:
        tenants = TenantDirectory.build(api_key)
    elif api_key:
        raise ValueError("pass api_key inside tenants (TenantDirectory.build)")
    parser = tool_parser(tool_call_parser) if tool_call_parser is not None else None
    thinking = REASONING_PARSERS[reasoning_parser] if reasoning_parser is not None else None
    gw = GatewayApp(
        backend,
        tokenizer,
        model_name,
        max_model_len,
        limits or GatewayLimits(),
        chat_template,
        tenants,
        parser,
        thinking,
        unrendered_token_ids,
    )

    async def completions(request: Request) -> Response:
        return await _guard(gw, gw.handle(request, COMPLETIONS))

    async def chat(request: Request) -> Response:
        return await _guard(gw, gw.handle(request, CHAT))

    async def responses(request: Request) -> Response:
        return await _guard(gw, gw.handle(request, RESPONSES))

    async def messages(request: Request) -> Response:
        return await _guard(gw, gw.handle(request, MESSAGES), anthropic_error)

    async def messages_count_tokens(request: Request) -> Response:
        return await _guard(gw, count_tokens(gw, request), anthropic_error)

    async def tokenize(request: Request) -> Response:
        return await _guard(gw, gw.tokenize(request))

    async def detokenize(request: Request) -> Response:
        return await _guard(gw, gw.detokenize(request))

    async def models(_: Request) -> Response:
        refused = gw.not_ready()
        if refused is not None:
            return refused.response()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "pdserve",
                        "root": model_root or model_name,  # the model folder
                        "max_model_len": max_model_len,
                    }
                ],
            }
        )

    async def health(_: Request) -> Response:
        ok, detail = backend.health()
        if ok:
            return JSONResponse({"status": "ok", **detail})
        refused = gw.not_ready()
        assert refused is not None
        body = {"error": {"message": refused.message, "type": refused.type, "param": None, "code": refused.code}}
        return JSONResponse({**body, "status": "unavailable", **detail}, status_code=503, headers=refused.headers)

    async def live(_: Request) -> Response:  # liveness: the event loop answers (workers or not)
        return JSONResponse({"status": "ok"})

    async def workers(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": backend.workers()})

    async def join(request: Request) -> Response:
        peer = request.client.host if request.client else "?"
        body = b""
        async for part in request.stream():  # a claim is ~200 bytes: read no more than a few KiB
            body += part
            if len(body) > MAX_JOIN_BYTES:
                return error_response(413, "join request too large", code="body_too_large")
        try:
            answer = backend.join(body, request.url.hostname or "127.0.0.1")
        except JoinRefused as e:
            log.warning("join refused for a worker at %s: %s", peer, e)
            return error_response(403, f"join refused: {e}", type_="authentication_error", code="join_refused")
        if answer is None:
            return error_response(404, "this gateway has no worker plane", code="not_found")
        return JSONResponse(msgspec.to_builtins(answer))

    async def metrics(_: Request) -> Response:
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")

    async def http_error(request: Request, exc: Exception) -> Response:  # unknown path, wrong method
        assert isinstance(exc, HTTPException)  # the only exception it is registered for
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        error = APIError(exc.status_code, str(exc.detail), code=code, headers=dict(exc.headers or {}))
        return anthropic_error(error) if request.url.path.startswith("/v1/messages") else error.response()

    app = Starlette(
        exception_handlers={HTTPException: http_error},
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/responses", responses, methods=["POST"]),
            Route("/v1/messages", messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", messages_count_tokens, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"]),
            Route("/v1/workers", workers, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/health/live", live, methods=["GET"]),
            Route(JOIN_PATH, join, methods=["POST"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/openapi.json", openapi_endpoint(gw), methods=["GET"]),
        ],
    )
    app.state.gateway = gw
    if tenants.requires_key:
        app.add_middleware(_ApiKeyMiddleware, tenants=tenants)
    return app


def _json_number(text: str) -> int | float:
    """A JSON number with a fraction or exponent: a whole one is an integer (5.0 is 5, as JSON
    Schema counts it), so a body's integer fields take it."""
    value = float(text)
    return int(value) if value.is_integer() else value


async def _guard(gw: GatewayApp, coro, error: Callable[[APIError], Response] = APIError.response) -> Response:
    """The handler's answer; an APIError (or an unexpected error: 500) written by `error`."""
    try:
        return await coro
    except APIError as e:
        gw.metrics.http_errors.labels(status=str(e.status)).inc()
        return error(e)
    except Exception:
        log.exception("unhandled error")
        gw.metrics.http_errors.labels(status="500").inc()
        return error(APIError(500, "internal server error", type_="server_error"))
