"""One generation run: an HTTP request's backend stream (gateway/output_stream.py, its outputs in
token order) read into one sequence of events (detokenized, stop strings applied, bounded per
client), written out as SSE or one JSON body. gateway/app.py owns the HTTP side;
gateway/formats.py the endpoint's response shapes.

Every request is one backend stream: n > 1, best_of and beam search too (one prefill, the KV
shared by the choices on the worker), whose outputs carry their choice's index.
A stop string that ends one choice of a group ends it here and asks the worker to stop that
member alone (Backend.stop_choice); the whole request is aborted upstream once every choice has
ended."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import msgspec
from msgspec.structs import replace
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve import tracing
from pdserve.gateway.admission import request_priority
from pdserve.gateway.backend import Backend, BackendUnavailable
from pdserve.gateway.detokenizer import IncrementalDetokenizer
from pdserve.gateway.errors import APIError
from pdserve.gateway.formats import FORMATS, LogprobEntries
from pdserve.gateway.limits import GatewayLimits
from pdserve.gateway.metrics import GatewayMetrics
from pdserve.gateway.output_stream import OutputStream
from pdserve.gateway.prompt_logprobs import echo_entries, vllm_prompt_logprobs
from pdserve.gateway.reasoning import ReasoningParser, ReasoningStream
from pdserve.gateway.schemas import ParsedRequest
from pdserve.gateway.stop_strings import StopMatcher
from pdserve.gateway.tools.constraint import call_reader
from pdserve.gateway.tools.parser import ToolParser
from pdserve.gateway.tools.stream import ToolCallStream, message_calls
from pdserve.protocol.messages import PromptLogprobs, TokenLogprob, TokenOutput
from pdserve.protocol.sampling import SamplingParams

if TYPE_CHECKING:
    from pdserve.gateway.rate_limits import Admission


_TAKEN = object()  # GenerationRun._pending once the output `start` took is handed on
_json = msgspec.json.Encoder().encode  # an SSE chunk's JSON as UTF-8 bytes (several times json.dumps' speed)


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
    reasoning: ReasoningStream | None = None  # its reasoning read apart (gateway/reasoning.py)

    def answer_reason(self, called: bool) -> str | None:
        """The finish_reason the client sees: OpenAI's "tool_calls" for an answer that called."""
        return "tool_calls" if called and self.finish_reason == "stop" else self.finish_reason


Event = tuple[Choice, str, list, str | None]  # (choice, text delta, logprob entries, finish_reason)


@dataclass(frozen=True)
class RunContext:
    """What a run needs of the gateway, built once by gateway/app.py (the app itself stays out)."""

    backend: Backend
    metrics: GatewayMetrics
    limits: GatewayLimits
    model_name: str
    token_text: Callable[[int], str]  # one token's text (logprob entries)
    text_decoder: Any  # the detokenizers' decode (gateway/text_decoder.py)
    tool_parser: ToolParser | None  # --tool-call-parser's
    tool_markers: dict[int, str]  # its markers the tokenizer holds as special tokens
    on_cut: Callable[[str], None]  # a stream cut for a slow client: counted
    on_done: Callable[[GenerationRun], None]  # the run's end, once: in-flight counts, the key's usage
    reasoning: ReasoningParser | None = None  # --reasoning-parser's: chat answers carry it apart
    reasoning_markers: dict[int, str] = field(default_factory=dict)  # its markers held as special tokens
    unrendered: frozenset[int] = frozenset()  # token ids that stand for no text (a GGUF's UNUSED ones)


class GenerationRun:
    """One HTTP request: its backend stream read into one sequence of events."""

    def __init__(
        self,
        ctx: RunContext,
        req: ParsedRequest,
        prompt: list[int],
        sampling: SamplingParams,  # the whole request's (a group's too); its priority orders admission
        base_id: str,
        arrival: float,
        traceparent: str | None,  # the client's W3C trace context, if it sent one
        admission: Admission,  # its API key's charge, released at the end (RunContext.on_done)
    ) -> None:
        self.ctx, self.req, self.prompt, self.base_id, self.arrival = ctx, req, prompt, base_id, arrival
        self.sampling = sampling
        self.admission = admission
        # one trace per request (pdserve/tracing.py): its context goes into every message sent
        self.span = tracing.start_span(
            "gateway.request",
            traceparent,
            attributes={"pdserve.request_id": base_id, "pdserve.prompt_tokens": len(prompt), "pdserve.n": req.n},
        )
        self.created = int(time.time())
        self._chunk_head: bytes | None = None  # an SSE chunk's text before its choices (`_chunk`)
        self.fmt = FORMATS[req.kind](ctx.token_text)  # the endpoint's response shapes
        reader = call_reader(req.tools, ctx.tool_parser)  # who reads its calls, if anyone
        keep = (
            dict(ctx.tool_markers) if reader is not None and reader is ctx.tool_parser else {}
        )  # its markers stay text
        thinking = ctx.reasoning if req.splits_reasoning else None
        if thinking is not None:
            keep |= ctx.reasoning_markers
            opened = thinking.prompt_opens(prompt, ctx.token_text)
        self.choices = [
            Choice(
                i,
                base_id,
                IncrementalDetokenizer(ctx.text_decoder, keep=keep or None, unrendered=ctx.unrendered),
                StopMatcher(req.stop),
            )
            for i in range(req.n)
        ]
        if reader is not None:
            for c in self.choices:
                c.tools = ToolCallStream(reader)
        if thinking is not None:
            for c in self.choices:
                c.reasoning = ReasoningStream(thinking, opened)
        self.unfinished = req.n  # choices without a finish_reason yet
        # the prompt's scores (echo with logprobs, prompt_logprobs), from the first output carrying them
        self.prompt_scores: PromptLogprobs | None = None
        self._pending: object = _TAKEN  # the output `start` took, until the events read it
        # one backend stream for every choice (n > 1 is a group: its outputs carry their choice)
        self.stream = OutputStream(ctx.limits.max_stream_buffer, on_cut=lambda: ctx.on_cut("buffer_full"))
        token = tracing.current_traceparent.set(self.span.traceparent if self.span else None)
        priority_token = request_priority.set(sampling.priority)
        try:
            ctx.backend.open(base_id, prompt, sampling, self.stream)
        finally:
            tracing.current_traceparent.reset(token)  # (the backend's tasks took a copy of the context)
            request_priority.reset(priority_token)

    async def start(self) -> APIError | TokenOutput | Exception | None:
        """Wait for the first output so capacity errors can still be a status code (an APIError
        the endpoint writes in its own shape)."""
        try:
            return await self.stream.get()
        except BackendUnavailable as e:  # refused before any token: a status code
            await self.cancel()
            self.ctx.metrics.http_errors.labels(status=str(e.status)).inc()
            if e.status == 400:  # it can never fit: the client's to change, not to retry
                return APIError(400, str(e), code=e.code)
            return APIError(
                e.status,
                str(e),
                type_="server_error",
                code=e.code,
                headers={"Retry-After": str(max(1, round(e.retry_after_s)))},
            )
        except Exception as e:  # a backend failure: an error event
            return e

    def _remaining(self) -> float | None:
        timeout = self.ctx.limits.request_timeout_s
        return None if timeout is None else max(0.0, self.arrival + timeout - time.monotonic())

    async def cancel(self) -> None:
        self.stream.close()  # aborts the request upstream unless it has ended
        if self.span is not None:  # the run is over: its trace's root span ends
            self.span.set("pdserve.output_tokens", sum(c.num_tokens for c in self.choices))
            self.span.set("pdserve.finish_reasons", ",".join(str(c.finish_reason) for c in self.choices))
            self.span.end()
            self.span = None
        await self.stream.aclose()  # the backend has stopped: its aborts are sent

    async def events(self, first: TokenOutput | Exception | None) -> AsyncIterator[Event]:
        """Yields (choice, text delta, logprob entries, finish_reason) until all choices end."""
        self._pending = first
        while (batch := await self._next_events()) is not None:
            for event in batch:
                yield event

    async def _next_events(self) -> list[Event] | None:
        """The events of the stream's next output (maybe none); None once every choice has ended."""
        if not self.unfinished:
            return None
        item: TokenOutput | Exception | None
        if self._pending is not _TAKEN:  # the output `start` took
            item, self._pending = cast("TokenOutput | Exception | None", self._pending), _TAKEN
        else:
            try:
                item = await self.stream.get(self._remaining())
            except TimeoutError:  # --request-timeout: abort upstream, end every choice
                await self.cancel()
                for c in self.choices:
                    c.timed_out = c.finish_reason is None
                return self._end_all("request timed out (--request-timeout)")
            except Exception as e:  # a cut, or a backend failure: ends every choice
                item = e
        if item is None:
            return self._end_all("backend stream ended")
        if isinstance(item, Exception):
            return self._end_all(str(item) or type(item).__name__)
        if item.prompt_logprobs is not None and self.prompt_scores is None:  # (a group run again sends them again)
            self.prompt_scores = item.prompt_logprobs
        if item.error is not None or item.finish_reason == "abort":  # the whole request
            targets = [c for c in self.choices if c.finish_reason is None]
        elif 0 <= item.seq_index < len(self.choices) and self.choices[item.seq_index].finish_reason is None:
            targets = [self.choices[item.seq_index]]
        else:
            return []
        events = []
        for choice in targets:
            delta, lps, reason, textless = self._apply(choice, item)
            if reason == "stop" and choice.stop.stops and item.finish_reason is None:
                # stop string: abort the rest upstream (a group's once every choice has ended)
                if not self.unfinished:
                    self.stream.close()
                else:  # the worker stops this member alone
                    self.ctx.backend.stop_choice(self.base_id, choice.index)
            if delta or lps or reason or textless:  # (a token of no text is an empty chunk, as llama.cpp's)
                events.append((choice, delta, lps, reason))
        return events

    def _end_all(self, error: str) -> list[Event]:
        """Every choice still open ends with `error`."""
        events: list[Event] = []
        for c in self.choices:
            if c.finish_reason is None:
                c.finish_reason, c.error = "error", error
                events.append((c, "", [], "error"))
        self.unfinished = 0
        return events

    def _apply(self, choice: Choice, out: TokenOutput) -> tuple[str, list, str | None, bool]:
        """`out` fed to the choice: (its text delta, logprob entries, finish reason, whether a
        token of it stands for no text: a GGUF file's UNUSED one)."""
        now = time.monotonic()
        if out.timings:
            choice.timings.update(out.timings)
        choice.cached_tokens = max(choice.cached_tokens, out.cached_tokens)
        if out.error is not None:
            choice.finish_reason, choice.error = "error", out.error
            self.unfinished -= 1
            return "", [], "error", False
        pieces, lps = [], []
        hit = False
        tokens = out.token_ids
        if self.req.scores_only:  # max_tokens 0: the token that ended the prefill is not the client's
            tokens = []
            if out.finish_reason in ("stop", "length"):
                out = replace(out, finish_reason="length")
        for k, token in enumerate(tokens):
            if choice.first_token_at is None:
                choice.first_token_at = now
                self.ctx.metrics.ttft.observe(now - self.arrival)
            choice.num_tokens += 1
            text, hit = choice.stop.feed(choice.detok.add(token))
            pieces.append(text)
            if out.logprobs is not None and k < len(out.logprobs):
                lps.append((self.ctx.token_text(token), out.logprobs[k]))
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
        return delta, lps, reason, any(t in choice.detok.unrendered for t in tokens)

    def _finish(self, choice: Choice, reason: str, now: float) -> None:
        choice.finish_reason = reason
        self.unfinished -= 1
        m = self.ctx.metrics
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

    def _chunk(self, choices: list[dict], **extra) -> bytes:
        obj = {
            "id": self.base_id,
            "object": self.fmt.chunk_object_name,
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
        }
        if extra:
            return b"data: " + _json(obj | extra) + b"\n\n"
        if self._chunk_head is None:  # the same for every chunk: encoded once
            self._chunk_head = b"data: " + _json(obj | {"choices": None})[: -len(b"null}")]
        return self._chunk_head + _json(choices) + b"}\n\n"

    async def sse(self, first):
        want_lp = self.req.logprobs is not None
        text_pos = [0] * len(self.choices)
        try:
            opening = self.fmt.opening_chunks([c.index for c in self.choices])
            if opening:
                yield self._chunk(opening)
            self._pending = first
            prompt_first = self.req.echo or self.req.prompt_logprobs is not None
            opened = [not prompt_first] * len(self.choices)  # a choice's prompt part sent (or none to send)
            while (batch := await self._next_events()) is not None:
                for choice, delta, lps, reason in batch:
                    extra: dict = {}
                    if not opened[choice.index] and reason != "error":
                        opened[choice.index] = True
                        delta, lps, extra = self._prompt_part(delta, lps)
                    for chunk in self._sse_chunks(choice, delta, lps, reason, want_lp, text_pos, extra):
                        yield chunk
            if self.req.include_usage:
                yield self._chunk([], usage=self._usage(), pdserve_timings=self._timings())
            yield b"data: [DONE]\n\n"
        finally:
            await self.close()

    def _prompt_part(self, delta: str, lps: list) -> tuple[str, list, dict]:
        """A completion choice's first streamed event with the prompt before it: echo's text and
        logprob entries, and vLLM's prompt_logprobs (for the chunk's item)."""
        extra = {}
        if self.req.prompt_logprobs is not None:
            extra["prompt_logprobs"] = self._vllm_prompt_logprobs()
        if self.req.echo:
            delta = self.echo_text() + delta
            if self.req.logprobs is not None:
                lps = self._echo_entries() + lps
        return delta, lps, extra

    def echo_text(self) -> str:
        """The prompt's text, as echo repeats it (token ids decoded by the tokenizer)."""
        return self.req.prompt_text or ""

    def _echo_entries(self) -> LogprobEntries:
        return echo_entries(self.prompt, self.prompt_scores, self.req.logprobs or 0, self.ctx.token_text)

    def _vllm_prompt_logprobs(self) -> list | None:
        return vllm_prompt_logprobs(self.prompt, self.prompt_scores, self.req.prompt_logprobs or 0, self.ctx.token_text)

    def _sse_chunks(
        self,
        choice: Choice,
        delta: str,
        lps: list,
        reason: str | None,
        want_lp: bool,
        text_pos: list[int],
        extra: dict | None = None,  # added to the first chunk's item (a choice's prompt_logprobs)
    ) -> list[bytes]:
        """One event's SSE chunks."""
        if reason == "error":
            err = {
                "message": choice.error or "generation failed",
                "type": "server_error",
                "param": None,
                "code": "generation_failed",
            }
            return [b"data: " + _json({"error": err}) + b"\n\n"]
        lp = self.fmt.logprobs(lps, text_pos[choice.index]) if want_lp else None
        text_pos[choice.index] += len(delta)
        calls: list[dict] = []
        thought = ""
        if choice.reasoning is not None:  # the reasoning apart; the answer is what follows
            thought, delta = choice.reasoning.feed(delta, final=reason is not None)
        if choice.tools is not None:  # markup withheld, calls sent as tool-call deltas
            delta, calls = choice.tools.feed(delta, final=reason is not None)
            reason = choice.answer_reason(choice.tools.has_calls) if reason is not None else None
            if not (delta or calls or lps or reason or thought):
                return []
        # OpenAI's shape: the content (and logprobs) first, then one chunk per tool-call entry
        items: list[tuple[str, dict | None, tuple]] = (
            [(delta, lp, ())] if (delta or lp is not None or not calls) else []
        )
        if choice.reasoning is not None and not (delta or thought or calls or lps or reason):
            return []  # (held back: a marker may be starting)
        items += [("", None, (entry,)) for entry in calls]
        last = reason is not None and not self.unfinished
        chunks = []
        for k, (text, item_lp, entries) in enumerate(items):
            final_item = k == len(items) - 1
            item = self.fmt.stream_item(choice.index, text, item_lp, reason if final_item else None, entries)
            if thought and k == 0:
                item["delta"]["reasoning_content"] = thought
            if extra and k == 0:
                item |= extra
            timed = final_item and last and not self.req.include_usage
            chunks.append(self._chunk([item], **({"pdserve_timings": self._timings()} if timed else {})))
        return chunks

    async def close(self) -> None:
        """The end of a streamed run, however it came (idempotent): client gone or done."""
        # _done() first: when the client hangs up, this runs inside a cancelled scope and the
        # await is cut short (cancel() has still told every backend stream to close).
        self.ctx.on_done(self)
        await self.cancel()  # close every backend stream

    def _final_choice(self, c: Choice, want_lp: bool) -> dict:
        text, calls = self.final_text(c)
        entries: LogprobEntries = list(c.logprobs)
        if self.req.echo:  # (completions) the prompt first
            text = self.echo_text() + text
            entries = self._echo_entries() + entries if want_lp else entries
        lp = self.fmt.logprobs(entries) if want_lp else None
        out = self.fmt.final_choice(c.index, text, lp, c.answer_reason(bool(calls)), calls)
        if c.reasoning is not None:  # vLLM's field: null when the output had none
            out["message"]["reasoning_content"] = self.final_reasoning(c)
        if self.req.prompt_logprobs is not None and self.req.kind == "completion":  # (chat: beside the choices)
            out["prompt_logprobs"] = self._vllm_prompt_logprobs()
        return out

    async def drain(self, first, request: Request) -> Response | APIError | None:
        """Read the whole run (not streamed): None when every choice ended well, else a 499 for a
        client gone, or the error to answer (504 past --request-timeout, 500 a failed generation)."""

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
            self.ctx.metrics.http_errors.labels(status="504").inc()
            return APIError(504, "request timed out (--request-timeout)", type_="server_error", code="timeout")
        errors = [c.error for c in self.choices if c.finish_reason == "error"]
        if errors:
            self.ctx.metrics.http_errors.labels(status="500").inc()
            return APIError(500, f"generation failed: {errors[0]}", type_="server_error", code="generation_failed")
        return None

    def final_text(self, c: Choice) -> tuple[str, list[dict]]:
        """A choice's whole answer: its text outside tool calls (and its reasoning), and the calls
        (OpenAI's shape)."""
        text = "".join(c.text)
        if c.reasoning is not None:
            _, text = c.reasoning.parser.split(text, c.reasoning.opened)
        if c.tools is None:
            return text, []
        parsed = c.tools.parser.parse(text)  # the whole output read at once, as the stream reads it
        return parsed.content, message_calls(parsed)

    def final_reasoning(self, c: Choice) -> str | None:
        """A choice's reasoning under --reasoning-parser (None without one, or when it had none)."""
        if c.reasoning is None:
            return None
        return c.reasoning.parser.split("".join(c.text), c.reasoning.opened)[0] or None

    async def collect(self, first, request: Request) -> Response:
        """OpenAI's answer (completions or chat) of a run read whole."""
        outcome = await self.drain(first, request)
        if isinstance(outcome, APIError):
            return outcome.response()
        if outcome is not None:
            return outcome
        want_lp = self.req.logprobs is not None
        choices = [self._final_choice(c, want_lp) for c in self.choices]
        body = {
            "id": self.base_id,
            "object": self.fmt.object_name,
            "created": self.created,
            "model": self.ctx.model_name,
            "choices": choices,
            "usage": self._usage(),
            "pdserve_timings": self._timings(),
        }
        if self.req.prompt_logprobs is not None and self.req.kind == "chat":  # (vLLM's place for chat's)
            body["prompt_logprobs"] = self._vllm_prompt_logprobs()
        return JSONResponse(body)
