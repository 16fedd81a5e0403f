"""Benchmark arithmetic on per-request timings; result keys named as vLLM's `vllm bench serve`.

TTFT  = first content chunk - request sent.
TPOT  = (e2e latency - TTFT) / (output tokens - 1), per request with > 1 output token.
ITL   = gaps between content chunks, pooled over all requests.
E2EL  = last byte - request sent.
Goodput = requests/s meeting every given SLO (DistServe); attainment = fraction meeting them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    success: bool
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float = 0.0  # seconds
    error: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # server's TTFT breakdown, if any
    text: str = ""  # the generated text (a conversation sends it back as the next turn's history)
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens, when the server reports it

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def meets_slos(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    if not r.success:
        return False
    values = {"ttft": r.ttft * 1e3, "e2el": r.latency * 1e3, "tpot": (r.tpot or 0.0) * 1e3}
    return all(values[k] <= v for k, v in slos_ms.items())


def compute_metrics(
    results: list[RequestResult],
    duration_s: float,
    *,
    percentiles: tuple[float, ...] = (50, 90, 99),
    selected: tuple[str, ...] = METRICS,
    goodput_slos_ms: dict[str, float] | None = None,
) -> dict:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    m: dict = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s > 0 else 0.0,
    }
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for t in (r.tpot for r in ok) if t is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok],
    }
    for name in selected:
        values = np.asarray(series[name], dtype=np.float64) * 1e3 if series[name] else np.zeros(1)
        m[f"mean_{name}_ms"] = float(values.mean())
        m[f"median_{name}_ms"] = float(np.median(values))
        m[f"std_{name}_ms"] = float(values.std())
        for p in percentiles:
            m[f"p{p:g}_{name}_ms"] = float(np.percentile(values, p))
    if goodput_slos_ms:
        good = sum(meets_slos(r, goodput_slos_ms) for r in results)
        m["request_goodput"] = good / duration_s if duration_s > 0 else 0.0
        m["goodput_attainment"] = good / len(results) if results else 0.0
    breakdown = [r.timings for r in ok if r.timings]
    if breakdown:
        keys = sorted({k for t in breakdown for k in t})
        m["ttft_breakdown_mean"] = {k: float(np.mean([t[k] for t in breakdown if k in t])) for k in keys}
    return m
