"""Per-request sampling parameters: one typed struct the gateway, prefill and decode share.

Plain msgspec (no torch import) so the gateway can build it cheaply and it crosses sockets as
msgpack. Validation of user input happens at the gateway; `__post_init__` only guards internal
invariants so a bad struct never reaches the sampler.
"""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_tokens: int = 16
    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = -1  # -1 or 0 => disabled
    min_p: float = 0.0  # [0, 1]
    seed: int | None = None  # per-request reproducible sampling
    repetition_penalty: float = 1.0  # HF-style, over prompt + output tokens
    presence_penalty: float = 0.0  # OpenAI-style, over output tokens
    frequency_penalty: float = 0.0  # OpenAI-style, over output tokens
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; N >= 0: chosen token + top-N
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits (OpenAI)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0.0:
            raise ValueError("repetition_penalty must be > 0")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise ValueError("logit_bias needs token ids >= 0 and biases in [-100, 100]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Anything that changes the logits before sampling (penalties, logit_bias)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )
