"""One generation run: an HTTP request's backend streams merged into one ordered sequence of
events (detokenized, stop strings applied, bounded per client), written out as SSE or one JSON
body. gateway/app.py owns the HTTP side; gateway/formats.py the endpoint's response shapes.

n = 1 is one backend stream. n > 1, best_of and beam search are one backend stream too (one
prefill, the KV shared by the choices on the worker) whose outputs carry their choice's index.
A stop string that ends one choice of a group ends it here and asks the worker to stop that
member alone (Backend.stop_choice); the whole request is aborted upstream once every choice has
ended."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve import tracing
from pdserve.gateway.admission import request_priority
from pdserve.gateway.backend import BackendUnavailable
from pdserve.gateway.detokenizer import IncrementalDetokenizer
from pdserve.gateway.errors import error_response
from pdserve.gateway.formats import FORMATS
from pdserve.gateway.schemas import ParsedRequest
from pdserve.gateway.stop_strings import StopMatcher
from pdserve.gateway.tools.stream import ToolCallStream, message_calls
from pdserve.protocol.messages import TokenLogprob, TokenOutput
from pdserve.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from pdserve.gateway.app import GatewayApp
    from pdserve.gateway.rate_limits import Admission


@dataclass
class Choice:
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
    cached_tokens: int = 0  # prompt tokens a worker found in its prefix cache
    tools: ToolCallStream | None = None  # its output read for tool calls (gateway/tools/)

    def answer_reason(self, called: bool) -> str | None:
        """The finish_reason the client sees: OpenAI's "tool_calls" for an answer that called."""
        return "tool_calls" if called and self.finish_reason == "stop" else self.finish_reason


class StreamCut(Exception):
    """A stream ended by the gateway because its client read too slowly."""


class GenerationRun:
    """One HTTP request: n backend streams merged into one sequence of events."""

    def __init__(
        self,
        app: GatewayApp,
        req: ParsedRequest,
        prompt: list[int],
        max_tokens: int,
        base_id: str,
        arrival: float,
        traceparent: str | None,  # the client's W3C trace context, if it sent one
        admission: Admission,  # its API key's charge, released at the end (GatewayApp._done)
        priority: int,  # its place in the admission queue (lower first)
    ) -> None:
        self.app, self.req, self.prompt, self.base_id, self.arrival = app, req, prompt, base_id, arrival
        self.admission = admission
        # one trace per request (pdserve/tracing.py): its context goes into every message sent
        self.span = tracing.start_span(
            "gateway.request",
            traceparent,
            attributes={"pdserve.request_id": base_id, "pdserve.prompt_tokens": len(prompt), "pdserve.n": req.n},
        )
        token = tracing.current_traceparent.set(self.span.traceparent if self.span else None)
        priority_token = request_priority.set(priority)
        self.created = int(time.time())
        self.fmt = FORMATS[req.kind](app._token_text)  # the endpoint's response shapes
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = [
            Choice(
                i,
                f"{base_id}-{i}" if req.n > 1 and not req.is_group else base_id,
                IncrementalDetokenizer(app.tokenizer),
                StopMatcher(req.stop),
            )
            for i in range(req.n)
        ]
        if req.tools is not None and req.tools.parsed and app.tool_parser is not None:
            for c in self.choices:
                c.tools = ToolCallStream(app.tool_parser)
        if req.is_group:  # one backend stream for all the choices
            self.tasks = [asyncio.create_task(self._pump(self.choices, app._sampling(req, max_tokens, 0)))]
        else:
            self.tasks = [
                asyncio.create_task(self._pump([c], app._sampling(req, max_tokens, c.index))) for c in self.choices
            ]
        tracing.current_traceparent.reset(token)  # (the tasks took a copy of the context)
        request_priority.reset(priority_token)
        self.open = req.n

    async def _pump(self, choices: list[Choice], sampling: SamplingParams) -> None:
        """One backend stream's outputs onto the queue, each with its choice (by `seq_index`)."""
        try:
            gen = self.app.backend.generate(choices[0].request_id, self.prompt, sampling)
            async with contextlib.aclosing(gen):
                async for out in gen:  # the backend ends its stream after the request's end
                    if self.queue.qsize() >= self.app.limits.max_stream_buffer:
                        # the client reads slower than tokens come: abort upstream (closing gen)
                        self.app.stream_cut("buffer_full")
                        cut = StreamCut(
                            f"stream cut: the client read too slowly ({self.queue.qsize()} outputs waiting)"
                        )
                        for c in choices:
                            self.queue.put_nowait((c, cut))
                        break
                    if out.error is not None or out.finish_reason == "abort":  # the whole request
                        for c in choices:
                            self.queue.put_nowait((c, out))
                    elif 0 <= out.seq_index < len(choices):
                        self.queue.put_nowait((choices[out.seq_index], out))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # BackendUnavailable or a backend failure: becomes an event
            for c in choices:
                self.queue.put_nowait((c, e))
        finally:
            for c in choices:
                self.queue.put_nowait((c, None))

    async def start(self):
        """Wait for the first event so capacity errors can still be a 503 status."""
        choice, item = await self.queue.get()
        if isinstance(item, BackendUnavailable):  # refused before any token: a status code
            await self.cancel()
            self.app.metrics.http_errors.labels(status=str(item.status)).inc()
            if item.status == 400:  # it can never fit: the client's to change, not to retry
                return error_response(400, str(item), code=item.code)
            return error_response(
                item.status,
                str(item),
                type_="server_error",
                code=item.code,
                headers={"Retry-After": str(max(1, round(item.retry_after_s)))},
            )
        return choice, item

    def _remaining(self) -> float | None:
        timeout = self.app.limits.request_timeout_s
        return None if timeout is None else max(0.0, self.arrival + timeout - time.monotonic())

    async def cancel(self) -> None:
        for t in self.tasks:
            t.cancel()
        if self.span is not None:  # the run is over: its trace's root span ends
            self.span.set("pdserve.output_tokens", sum(c.num_tokens for c in self.choices))
            self.span.set("pdserve.finish_reasons", ",".join(str(c.finish_reason) for c in self.choices))
            self.span.end()
            self.span = None
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
                # stop string: abort the rest upstream (a group's once every choice has ended)
                if not self.req.is_group:
                    self.tasks[choice.index].cancel()
                elif all(c.finish_reason is not None for c in self.choices):
                    self.tasks[0].cancel()
                else:  # the worker stops this member alone
                    self.app.backend.stop_choice(self.choices[0].request_id, choice.index)
            if delta or lps or reason:
                yield choice, delta, lps, reason

    def _apply(self, choice: Choice, out: TokenOutput):
        now = time.monotonic()
        if out.timings:
            choice.timings.update(out.timings)
        choice.cached_tokens = max(choice.cached_tokens, out.cached_tokens)
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

    def _finish(self, choice: Choice, reason: str, now: float) -> None:
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
        return {
            "prompt_tokens": len(self.prompt),
            "completion_tokens": completion,
            "total_tokens": len(self.prompt) + completion,
            "prompt_tokens_details": {"cached_tokens": max(c.cached_tokens for c in self.choices)},
        }

    def _timings(self) -> dict:
        merged: dict[str, float] = {}
        for c in self.choices:
            merged.update(c.timings)
        if self.choices[0].first_token_at is not None:
            merged["ttft_s"] = self.choices[0].first_token_at - self.arrival
        return merged

    def _chunk(self, choices: list[dict], **extra) -> str:
        obj = {
            "id": self.base_id,
            "object": self.fmt.chunk_object_name,
            "created": self.created,
            "model": self.app.model_name,
            "choices": choices,
            **extra,
        }
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    async def sse(self, first):
        want_lp = self.req.logprobs is not None
        text_pos = [0] * len(self.choices)
        try:
            opening = self.fmt.opening_chunks([c.index for c in self.choices])
            if opening:
                yield self._chunk(opening)
            async for choice, delta, lps, reason in self.events(first):
                if reason == "error":
                    err = {
                        "message": choice.error or "generation failed",
                        "type": "server_error",
                        "param": None,
                        "code": "generation_failed",
                    }
                    yield f"data: {json.dumps({'error': err})}\n\n"
                    continue
                lp = self.fmt.logprobs(lps, text_pos[choice.index]) if want_lp else None
                text_pos[choice.index] += len(delta)
                calls = []
                if choice.tools is not None:  # markup withheld, calls sent as tool-call deltas
                    delta, calls = choice.tools.feed(delta, final=reason is not None)
                    reason = choice.answer_reason(choice.tools.has_calls) if reason is not None else None
                    if not (delta or calls or lps or reason):
                        continue
                # OpenAI's shape: the content (and logprobs) first, then one chunk per tool-call entry
                items = [(delta, lp, ())] if (delta or lp is not None or not calls) else []
                items += [("", None, (entry,)) for entry in calls]
                last = reason is not None and all(c.finish_reason is not None for c in self.choices)
                for k, (text, item_lp, entries) in enumerate(items):
                    final_item = k == len(items) - 1
                    item = self.fmt.stream_item(choice.index, text, item_lp, reason if final_item else None, entries)
                    timed = final_item and last and not self.req.include_usage
                    yield self._chunk([item], **({"pdserve_timings": self._timings()} if timed else {}))
            if self.req.include_usage:
                yield self._chunk([], usage=self._usage(), pdserve_timings=self._timings())
            yield "data: [DONE]\n\n"
        finally:
            await self.close()

    async def close(self) -> None:
        """The end of a streamed run, however it came (idempotent): client gone or done."""
        # _done() first: when the client hangs up, this runs inside a cancelled scope and the
        # await is cut short (cancel() has still told every backend stream to close).
        self.app._done(self)
        await self.cancel()  # close every backend stream

    def _final_choice(self, c: Choice, want_lp: bool) -> dict:
        text, calls = "".join(c.text), []
        if c.tools is not None:  # the whole output read at once, as the stream reads it
            parsed = c.tools.parser.parse(text)
            text, calls = parsed.content, message_calls(parsed)
        lp = self.fmt.logprobs(c.logprobs) if want_lp else None
        return self.fmt.final_choice(c.index, text, lp, c.answer_reason(bool(calls)), calls)

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
            return error_response(504, "request timed out (--request-timeout)", type_="server_error", code="timeout")
        errors = [c.error for c in self.choices if c.finish_reason == "error"]
        if errors:
            self.app.metrics.http_errors.labels(status="500").inc()
            return error_response(
                500, f"generation failed: {errors[0]}", type_="server_error", code="generation_failed"
            )
        want_lp = self.req.logprobs is not None
        choices = [self._final_choice(c, want_lp) for c in self.choices]
        return JSONResponse(
            {
                "id": self.base_id,
                "object": self.fmt.object_name,
                "created": self.created,
                "model": self.app.model_name,
                "choices": choices,
                "usage": self._usage(),
                "pdserve_timings": self._timings(),
            }
        )
