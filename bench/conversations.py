"""`pdserve bench --dataset-name conversations`: multi-turn chats, the traffic a prefix cache is for.

Every conversation opens with one shared system prompt (--conv-system-len tokens), then
--conv-turns user turns (MIN-MAX), each --conv-user-len tokens of new text; each turn sends the
whole history (system prompt, earlier turns and their answers) to /v1/chat/completions, reads
the answer, thinks (exponential, mean --conv-think-time s) and asks the next. Conversations
start as a Poisson process at --request-rate per second (inf: all at once), --num-prompts of
them. Results: the usual metrics over every turn, and per turn index the TTFT percentiles,
the prompt tokens the server found cached (usage.prompt_tokens_details.cached_tokens) and the
KV bytes that crossed from a prefill to a decode worker (pdserve_timings.kv_bytes).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import numpy as np

from pdserve.bench.arrivals import arrival_offsets
from pdserve.bench.client import send
from pdserve.bench.datasets import BenchRequest, random_requests
from pdserve.bench.metrics import RequestResult


@dataclass(frozen=True)
class Conversation:
    system: str
    users: list[str]  # one new user message per turn
    output_len: int


def make_conversations(
    tokenizer, n: int, system_len: int, turns: tuple[int, int], user_len: int, output_len: int, seed: int
) -> list[Conversation]:
    rng = np.random.default_rng(seed)
    system = str(random_requests(tokenizer, 1, system_len, 1, seed=seed)[0].prompt)
    counts = rng.integers(turns[0], turns[1] + 1, size=n).tolist()
    texts = [str(r.prompt) for r in random_requests(tokenizer, sum(counts), user_len, 1, seed=seed + 1)]
    out, at = [], 0
    for c in counts:
        out.append(Conversation(system, texts[at : at + c], output_len))
        at += c
    return out


async def run_conversations(
    base_url: str,
    model: str,
    tokenizer,
    convs: list[Conversation],
    *,
    rate: float,
    think_time_s: float,
    ignore_eos: bool,
    seed: int,
    timeout_s: float = 600.0,
) -> tuple[list[tuple[int, RequestResult]], float]:
    """Every turn's (turn index, result), and the run's duration."""
    url = base_url.rstrip("/") + "/v1/chat/completions"
    rng = np.random.default_rng(seed)
    offsets = arrival_offsets(len(convs), rate, 1.0, seed)
    thinks = [rng.exponential(think_time_s, size=len(c.users)).tolist() for c in convs]
    results: list[tuple[int, RequestResult]] = []
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout_s, sock_read=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.perf_counter()

        async def conversation(conv: Conversation, at: float, think: list[float]) -> None:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            messages = [{"role": "system", "content": conv.system}]
            for turn, user in enumerate(conv.users):
                messages.append({"role": "user", "content": user})
                payload: dict = {
                    "model": model,
                    "messages": list(messages),
                    "max_tokens": conv.output_len,
                    "temperature": 0.0,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                if ignore_eos:
                    payload |= {"ignore_eos": True, "min_tokens": conv.output_len}
                result = await send(session, url, payload, BenchRequest(user, 0, conv.output_len), tokenizer)
                results.append((turn, result))
                if not result.success:
                    return  # the conversation cannot go on without its answer
                messages.append({"role": "assistant", "content": result.text})
                if turn + 1 < len(conv.users):
                    await asyncio.sleep(think[turn])

        await asyncio.gather(*[conversation(c, at, th) for c, at, th in zip(convs, offsets, thinks)])
        return results, time.perf_counter() - start


def per_turn(results: list[tuple[int, RequestResult]]) -> dict[str, dict]:
    """Per turn index: how many, TTFT p50/p90 (ms), mean cached prompt tokens and KV bytes sent."""
    out: dict[str, dict] = {}
    for turn in sorted({t for t, _ in results}):
        ok = [r for t, r in results if t == turn and r.success]
        if not ok:
            continue
        ttft = np.asarray([r.ttft for r in ok]) * 1e3
        out[str(turn + 1)] = {
            "completed": len(ok),
            "median_ttft_ms": float(np.median(ttft)),
            "p90_ttft_ms": float(np.percentile(ttft, 90)),
            "mean_prompt_tokens": float(np.mean([r.prompt_len for r in ok])),
            "mean_cached_tokens": float(np.mean([r.cached_tokens for r in ok])),
            "mean_kv_bytes": float(np.mean([r.timings.get("kv_bytes", 0.0) for r in ok])),
        }
    return out
