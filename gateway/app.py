"""OpenAI-compatible HTTP API over a `Backend`: validation, tokenization, n-way fan-out,
incremental detokenization, stop strings, SSE streaming, usage, logprobs, metrics.

Request ids are made here (`cmpl-...`/`chatcmpl-...`), never taken from the client. Leaving a
request early for any reason (client gone, stop string, error) closes its backend streams,
which aborts the request on every worker holding it.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.gateway.backend import Backend, BackendUnavailable
from pdserve.gateway.detokenizer import IncrementalDetokenizer
from pdserve.gateway.errors import APIError, error_response, invalid
from pdserve.gateway.limits import GatewayLimits
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.openapi import openapi_endpoint
from pdserve.gateway.schemas import ParsedRequest, parse_request
from pdserve.gateway.slow_clients import WriteTimeout
from pdserve.gateway.stop_strings import StopMatcher
from pdserve.protocol.messages import TokenLogprob, TokenOutput
from pdserve.protocol.sampling import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class _Choice:
    index: int
    request_id: str
    detok: IncrementalDetokenizer
    stop: StopMatcher
    num_tokens: int = 0
    text: list[str] = field(default_factory=list)
    logprobs: list[tuple[str, TokenLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    timed_out: bool = False


class StreamCut(Exception):
    """A stream ended by the gateway because its client read too slowly."""


class _EventStream(StreamingResponse):
    """An SSE response that closes its event generator however the response ends: a write cut
    short (slow_clients.WriteTimeout) would otherwise leave the generator suspended, its
    request still counted in flight, until garbage collection."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class _ApiKeyMiddleware:
    """Pure ASGI: rejects /v1/* without the right bearer token before any body is read."""

    def __init__(self, app, api_key: str) -> None:
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            auth = dict(scope.get("headers", [])).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):
                resp = error_response(401, "invalid or missing API key", type_="authentication_error",
                                      code="invalid_api_key")
                return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


class GatewayApp:
    def __init__(self, backend: Backend, tokenizer, model_name: str, max_model_len: int,
                 limits: GatewayLimits, chat_template: str | None) -> None:
        self.backend = backend
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.limits = limits
        self.chat_template = chat_template
        self.vocab_size = len(tokenizer)
        self.metrics = GatewayMetrics(backend.worker_stats, backend.routed_requests, backend.queue_stats,
                                      tuple(backend.collectors()))
        self.in_flight = 0

    # --- plumbing ---------------------------------------------------------------------------
    async def _read_json(self, request: Request):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            raise APIError(413, f"request body over {self.limits.max_body_bytes} bytes", code="body_too_large")
        body = bytearray()
        chunks = request.stream().__aiter__()
        while True:
            try:  # a client that stops sending its body holds nothing for long
                chunk = await asyncio.wait_for(chunks.__anext__(), self.limits.body_read_timeout_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise APIError(408, f"request body not received within {self.limits.body_read_timeout_s:g} s",
                               code="body_timeout") from None
            body += chunk
            if len(body) > self.limits.max_body_bytes:
                raise APIError(413, f"request body over {self.limits.max_body_bytes} bytes", code="body_too_large")
        try:
            return json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise invalid(f"malformed JSON body: {e}") from None

    def _tokenize(self, req: ParsedRequest) -> list[int]:
        if req.prompt_ids is not None:
            return req.prompt_ids
        if req.messages is not None:
            if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
                raise invalid("this model has no chat template: use /v1/completions, or start the server "
                              "with --chat-template FILE", "messages")
            text = self.tokenizer.apply_chat_template(req.messages, chat_template=self.chat_template,
                                                      add_generation_prompt=True, tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(req.prompt_text)

    def _sampling(self, req: ParsedRequest, max_tokens: int, i: int) -> SamplingParams:
        seed = None if req.seed is None else (req.seed + i) % 2**63
        return SamplingParams(
            max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
            min_p=req.min_p, seed=seed, repetition_penalty=req.repetition_penalty,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            stop_token_ids=tuple(req.stop_token_ids), ignore_eos=req.ignore_eos,
            min_tokens=min(req.min_tokens, max_tokens), logprobs=req.logprobs, logit_bias=tuple(req.logit_bias))

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # --- one request --------------------------------------------------------------------------
    async def handle(self, request: Request, kind: str) -> Response:
        arrival = time.monotonic()
        try:
            req = parse_request(await self._read_json(request), kind, self.limits)
            if req.model is not None and req.model != self.model_name:
                raise APIError(404, f"model '{req.model}' does not exist; this server serves "
                               f"'{self.model_name}'", param="model", code="model_not_found")
            prompt = await asyncio.to_thread(self._tokenize, req)
            if not prompt:
                raise invalid("the prompt is empty after tokenization", "prompt")
            bad = next((t for t in prompt if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise invalid(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", "prompt")
            bad = next((t for t, _ in req.logit_bias if t >= self.vocab_size), None)
            if bad is not None:
                raise invalid(f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab_size})",
                              "logit_bias")
            max_tokens = req.max_tokens if req.max_tokens is not None else max(1, self.max_model_len - len(prompt))
            if len(prompt) + max_tokens > self.max_model_len:
                raise invalid(f"this model's maximum context length is {self.max_model_len} tokens; the "
                              f"prompt has {len(prompt)} and max_tokens is {max_tokens} "
                              f"({len(prompt) + max_tokens} in total)", "max_tokens")
        except APIError as e:
            self.metrics.http_errors.labels(status=str(e.status)).inc()
            return e.response()
        base_id = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
        run = _Run(self, req, prompt, max_tokens, base_id, arrival)
        self.in_flight += 1
        self.metrics.in_flight.inc()
        try:
            first = await run.start()
        except BaseException:
            self._done()
            raise
        if isinstance(first, Response):
            self._done()
            return first
        if req.stream:
            return _EventStream(run.sse(first), media_type="text/event-stream",
                                headers={"Cache-Control": "no-cache"})
        try:
            return await run.collect(first, request)
        finally:
            self._done()

    def stream_cut(self, reason: str) -> None:
        self.metrics.streams_cut.labels(reason=reason).inc()
        if reason == "buffer_full":
            log.warning("aborted a request whose client read too slowly (%d outputs waiting)",
                        self.limits.max_stream_buffer)

    def _done(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.dec()


class _Run:
    """One HTTP request: n backend streams merged into one sequence of events."""

    def __init__(self, app: GatewayApp, req: ParsedRequest, prompt: list[int], max_tokens: int,
                 base_id: str, arrival: float) -> None:
        self.app, self.req, self.prompt, self.base_id, self.arrival = app, req, prompt, base_id, arrival
        self.created = int(time.time())
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = [_Choice(i, f"{base_id}-{i}" if req.n > 1 else base_id,
                                IncrementalDetokenizer(app.tokenizer), StopMatcher(req.stop))
                        for i in range(req.n)]
        self.tasks = [asyncio.create_task(self._pump(c, app._sampling(req, max_tokens, c.index)))
                      for c in self.choices]
        self.open = req.n

    async def _pump(self, choice: _Choice, sampling: SamplingParams) -> None:
        try:
            async with contextlib.aclosing(self.app.backend.generate(choice.request_id, self.prompt, sampling)) as gen:
                async for out in gen:  # the backend ends its stream after a finish
                    if self.queue.qsize() >= self.app.limits.max_stream_buffer:
                        # the client reads slower than tokens come: abort upstream (closing gen)
                        self.app.stream_cut("buffer_full")
                        self.queue.put_nowait((choice, StreamCut(
                            f"stream cut: the client read too slowly ({self.queue.qsize()} outputs waiting)")))
                        break
                    self.queue.put_nowait((choice, out))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # BackendUnavailable or a backend failure: becomes an event
            self.queue.put_nowait((choice, e))
        finally:
            self.queue.put_nowait((choice, None))

    async def start(self):
        """Wait for the first event so capacity errors can still be a 503 status."""
        choice, item = await self.queue.get()
        if isinstance(item, BackendUnavailable):  # refused before any token: a status code
            await self.cancel()
            self.app.metrics.http_errors.labels(status=str(item.status)).inc()
            return error_response(item.status, str(item), type_="server_error", code=item.code,
                                  headers={"Retry-After": str(max(1, round(item.retry_after_s)))})
        return choice, item

    def _remaining(self) -> float | None:
        timeout = self.app.limits.request_timeout_s
        return None if timeout is None else max(0.0, self.arrival + timeout - time.monotonic())

    async def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def events(self, first):
        """Yields (choice, text delta, logprob entries, finish_reason) until all choices end."""
        pending = first
        while self.open:
            if pending is None:
                try:
                    pending = await asyncio.wait_for(self.queue.get(), self._remaining())
                except asyncio.TimeoutError:  # --request-timeout: abort upstream, end every choice
                    await self.cancel()
                    for c in self.choices:
                        if c.finish_reason is None:
                            c.finish_reason, c.error = "error", "request timed out (--request-timeout)"
                            c.timed_out = True
                            yield c, "", [], "error"
                    return
            choice, item = pending
            pending = None
            if item is None:
                self.open -= 1
                if choice.finish_reason is None:  # stream ended without a finish
                    choice.finish_reason, choice.error = "error", choice.error or "backend stream ended"
                    yield choice, "", [], "error"
                continue
            if choice.finish_reason is not None:
                continue
            if isinstance(item, Exception):
                choice.finish_reason, choice.error = "error", str(item) or type(item).__name__
                yield choice, "", [], "error"
                continue
            delta, lps, reason = self._apply(choice, item)
            if reason == "stop" and choice.stop.stops and item.finish_reason is None:
                self.tasks[choice.index].cancel()  # stop string: abort the rest upstream
            if delta or lps or reason:
                yield choice, delta, lps, reason

    def _apply(self, choice: _Choice, out: TokenOutput):
        now = time.monotonic()
        if out.timings:
            choice.timings.update(out.timings)
        if out.error is not None:
            choice.finish_reason, choice.error = "error", out.error
            return "", [], "error"
        pieces, lps = [], []
        hit = False
        for k, token in enumerate(out.token_ids):
            if choice.first_token_at is None:
                choice.first_token_at = now
                self.app.metrics.ttft.observe(now - self.arrival)
            choice.num_tokens += 1
            text, hit = choice.stop.feed(choice.detok.add(token))
            pieces.append(text)
            if out.logprobs is not None and k < len(out.logprobs):
                lps.append((self.app._token_text(token), out.logprobs[k]))
            if hit:
                break
        reason = "stop" if hit else out.finish_reason
        if reason is not None and not hit:
            tail, hit2 = choice.stop.feed(choice.detok.flush())
            pieces.append(tail if hit2 else tail + choice.stop.flush())
            if hit2:
                reason = "stop"
        if reason is not None:
            self._finish(choice, reason, now)
        delta = "".join(pieces)
        choice.text.append(delta)
        choice.logprobs.extend(lps)
        return delta, lps, reason

    def _finish(self, choice: _Choice, reason: str, now: float) -> None:
        choice.finish_reason = reason
        m = self.app.metrics
        m.finished.labels(finish_reason=reason).inc()
        m.e2e.observe(now - self.arrival)
        if choice.first_token_at is not None and choice.num_tokens > 1:
            m.tpot.observe((now - choice.first_token_at) / (choice.num_tokens - 1))
        m.observe_timings(choice.timings)

    # --- response shapes ----------------------------------------------------------------------
    def _usage(self) -> dict:
        completion = sum(c.num_tokens for c in self.choices)
        return {"prompt_tokens": len(self.prompt), "completion_tokens": completion,
                "total_tokens": len(self.prompt) + completion}

    def _timings(self) -> dict:
        merged: dict[str, float] = {}
        for c in self.choices:
            merged.update(c.timings)
        if self.choices[0].first_token_at is not None:
            merged["ttft_s"] = self.choices[0].first_token_at - self.arrival
        return merged

    def _logprobs_json(self, entries: list[tuple[str, TokenLogprob]], offset: int = 0):
        tok = self.app._token_text
        if self.req.kind == "chat":
            return {"content": [{"token": t, "logprob": lp.logprob, "bytes": list(t.encode()),
                                 "top_logprobs": [{"token": tok(i), "logprob": v, "bytes": list(tok(i).encode())}
                                                  for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                                for t, lp in entries]}
        offsets, pos = [], offset
        for t, _ in entries:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": [t for t, _ in entries], "token_logprobs": [lp.logprob for _, lp in entries],
                "top_logprobs": [{tok(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)} for _, lp in entries],
                "text_offset": offsets}

    def _chunk(self, choices: list[dict], **extra) -> str:
        obj = {"id": self.base_id, "object": "chat.completion.chunk" if self.req.kind == "chat" else "text_completion",
               "created": self.created, "model": self.app.model_name, "choices": choices, **extra}
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def sse(self, first):
        want_lp = self.req.logprobs is not None
        text_pos = [0] * len(self.choices)
        try:
            if self.req.kind == "chat":
                yield self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None} for c in self.choices])
            async for choice, delta, lps, reason in self.events(first):
                if reason == "error":
                    err = {"message": choice.error or "generation failed", "type": "server_error",
                           "param": None, "code": "generation_failed"}
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    continue
                lp = self._logprobs_json(lps, text_pos[choice.index]) if want_lp else None
                text_pos[choice.index] += len(delta)
                if self.req.kind == "chat":
                    item = {"index": choice.index, "delta": {"content": delta} if delta else {},
                            "logprobs": lp, "finish_reason": reason}
                else:
                    item = {"index": choice.index, "text": delta, "logprobs": lp, "finish_reason": reason}
                last = reason is not None and self.open <= 1 and all(
                    c.finish_reason is not None for c in self.choices)
                extra = {"pdserve_timings": self._timings()} if last and not self.req.include_usage else {}
                yield self._chunk([item], **extra)
            if self.req.include_usage:
                yield self._chunk([], usage=self._usage(), pdserve_timings=self._timings())
            yield "data: [DONE]\n\n"
        finally:
            # _done() first: when the client hangs up, this runs inside a cancelled scope and the
            # await is cut short (cancel() has still told every backend stream to close).
            self.app._done()
            await self.cancel()  # client gone or done: close every backend stream

    async def collect(self, first, request: Request) -> Response:
        async def drain():
            async for _ in self.events(first):
                pass

        task = asyncio.create_task(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    task.cancel()
                    await self.cancel()
                    return Response(status_code=499)
            task.result()
        finally:
            await self.cancel()
        if any(c.timed_out for c in self.choices):
            self.app.metrics.http_errors.labels(status="504").inc()
            return error_response(504, "request timed out (--request-timeout)", type_="server_error",
                                  code="timeout")
        errors = [c.error for c in self.choices if c.finish_reason == "error"]
        if errors:
            self.app.metrics.http_errors.labels(status="500").inc()
            return error_response(500, f"generation failed: {errors[0]}", type_="server_error",
                                  code="generation_failed")
        want_lp = self.req.logprobs is not None
        choices = []
        for c in self.choices:
            text = "".join(c.text)
            lp = self._logprobs_json(c.logprobs) if want_lp else None
            if self.req.kind == "chat":
                choices.append({"index": c.index, "message": {"role": "assistant", "content": text},
                                "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                choices.append({"index": c.index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason})
        return JSONResponse({"id": self.base_id, "object": "chat.completion" if self.req.kind == "chat" else "text_completion",
                             "created": self.created, "model": self.app.model_name, "choices": choices,
                             "usage": self._usage(), "pdserve_timings": self._timings()})


def create_app(backend: Backend, tokenizer, *, model_name: str, max_model_len: int,
               limits: GatewayLimits | None = None, api_key: str | None = None,
               chat_template: str | None = None, model_root: str | None = None) -> Starlette:
    gw = GatewayApp(backend, tokenizer, model_name, max_model_len, limits or GatewayLimits(), chat_template)

    async def completions(request: Request) -> Response:
        return await _guard(gw, gw.handle(request, "completion"))

    async def chat(request: Request) -> Response:
        return await _guard(gw, gw.handle(request, "chat"))

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model",
                                                         "created": 0, "owned_by": "pdserve",
                                                         "root": model_root or model_name,  # the model folder
                                                         "max_model_len": max_model_len}]})

    async def health(_: Request) -> Response:
        ok, detail = backend.health()
        return JSONResponse({"status": "ok" if ok else "unavailable", **detail}, status_code=200 if ok else 503)

    async def metrics(_: Request) -> Response:
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4")

    async def http_error(_: Request, exc: HTTPException) -> Response:  # unknown path, wrong method
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(exc.status_code, str(exc.detail), code=code, headers=exc.headers)

    app = Starlette(exception_handlers={HTTPException: http_error}, routes=[
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/openapi.json", openapi_endpoint(gw), methods=["GET"]),
    ])
    app.state.gateway = gw
    app.add_middleware(WriteTimeout, timeout_s=gw.limits.stream_write_timeout_s, on_cut=gw.stream_cut)
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)
    return app


async def _guard(gw: GatewayApp, coro) -> Response:
    try:
        return await coro
    except APIError as e:
        gw.metrics.http_errors.labels(status=str(e.status)).inc()
        return e.response()
    except Exception:
        log.exception("unhandled error")
        gw.metrics.http_errors.labels(status="500").inc()
        return error_response(500, "internal server error", type_="server_error")
