"""One streamed request to any OpenAI-compatible server, timed per content chunk.

aiohttp, as vLLM's `bench serve` uses: the load generator shares the machine with the server
under test, and aiohttp's C parser takes ~half of httpx's CPU per streamed chunk.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp

from pdserve.bench.datasets import BenchRequest
from pdserve.bench.metrics import RequestResult


def build_payload(
    req: BenchRequest, model: str, endpoint: str, *, temperature: float, ignore_eos: bool, n: int = 1
) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.endswith("chat/completions"):
        text = req.prompt if isinstance(req.prompt, str) else None
        if text is None:
            raise ValueError("token-id prompts need /v1/completions")
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    if n > 1:  # n choices of each prompt (usage.completion_tokens counts them all)
        body["n"] = n
    if ignore_eos:  # servers that know these honour them; min_tokens pins the length for the rest
        body["ignore_eos"] = True
        body["min_tokens"] = req.output_len
    return body


async def send(
    session: aiohttp.ClientSession, url: str, payload: dict, req: BenchRequest, tokenizer=None
) -> RequestResult:
    start = time.perf_counter()
    ttft, last, itl, text, usage = None, start, [], [], None
    timings: dict = {}
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode(errors="replace")[:300]
                return RequestResult(False, req.prompt_len, error=f"HTTP {resp.status}: {body}")
            async for raw in resp.content:  # one SSE line at a time
                if not raw.startswith(b"data:"):
                    continue
                data = raw[5:].strip()
                if data == b"[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    return RequestResult(False, req.prompt_len, error=str(obj["error"]))
                usage = obj.get("usage") or usage
                timings = obj.get("pdserve_timings") or timings
                for choice in obj.get("choices") or []:
                    piece = choice.get("text")
                    if piece is None:
                        piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if ttft is None:
                            ttft = now - start
                        else:
                            itl.append(now - last)
                        last = now
                        text.append(piece)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, ValueError) as e:
        return RequestResult(False, req.prompt_len, error=f"{type(e).__name__}: {e}")
    latency = time.perf_counter() - start
    if ttft is None:
        return RequestResult(False, req.prompt_len, latency=latency, error="no content received")
    if usage and usage.get("completion_tokens"):
        n_out = int(usage["completion_tokens"])
    elif tokenizer is not None:
        n_out = len(tokenizer.encode("".join(text), add_special_tokens=False))
    else:
        n_out = len(itl) + 1
    details = (usage or {}).get("prompt_tokens_details") or {}
    return RequestResult(
        True,
        int((usage or {}).get("prompt_tokens") or req.prompt_len),
        n_out,
        ttft,
        itl,
        latency,
        timings={k: float(v) for k, v in timings.items()},
        text="".join(text),
        cached_tokens=int(details.get("cached_tokens") or 0),
    )
