"""`--speculative-config` as vLLM names it: `{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": 4, "prompt_lookup_min": 1}`, or a draft model `{"model": DIR,
"num_speculative_tokens": k}` (`"method": "draft_model"` optional), plus vLLM's
`disable_by_batch_size`; or an EAGLE head `{"method": "eagle", "model": DIR,
"num_speculative_tokens": k}` (engine/spec/eagle.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

SPECULATION_METHODS = ("ngram", "draft_model", "eagle")
# Measured (docs/benchmarks/speculation.md, a 30-layer 115M model, one CPU thread): with drafts
# nearly all accepted the gain falls from 3.1x at one sequence to 1.6x at 16 and 1.3x at 32, where
# a step no longer fits the fused decode (1-16 rows) and every miss costs more rows: off beyond 16.
DEFAULT_DISABLE_BY_BATCH_SIZE = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    # the draft model's folder (method "draft_model"; same tokenizer as the target) or the EAGLE head's
    model: str | None = None
    num_speculative_tokens: int = 4  # k: most drafts a sequence proposes per step
    prompt_lookup_max: int = 4  # longest tail n-gram looked up
    prompt_lookup_min: int = 1  # shortest
    # no speculation in a step with more decoding sequences than this (vLLM's name)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # speculate only at batch sizes where it is measured to pay (engine/measured_choice.py); off:
    # in every step up to disable_by_batch_size (as vLLM does; benchmarks and exactness checks)
    measure_payoff: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATION_METHODS:
            raise ValueError(f"speculative method must be one of {SPECULATION_METHODS}, got {self.method!r}")
        if (self.method in ("draft_model", "eagle")) != (self.model is not None):
            raise ValueError(
                'a draft model or EAGLE head needs "model": DIR, and "model" needs method "draft_model" or "eagle"'
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size < 1:
            raise ValueError("disable_by_batch_size must be >= 1")

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """The flag's JSON; ValueError naming what is wrong (unknown keys, a draft model)."""
        try:
            raw: Any = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        if "model" in raw:
            if not isinstance(raw["model"], str) or not raw["model"]:
                raise ValueError('--speculative-config: "model" must be a draft model\'s folder')
            raw.setdefault("method", "draft_model")
        known = {
            "method",
            "model",
            "num_speculative_tokens",
            "prompt_lookup_max",
            "prompt_lookup_min",
            "disable_by_batch_size",
            "measure_payoff",
        }
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        if "measure_payoff" in raw and not isinstance(raw["measure_payoff"], bool):
            raise ValueError("--speculative-config: measure_payoff must be true or false")
        for key in known - {"method", "model", "measure_payoff"}:
            if key in raw and (not isinstance(raw[key], int) or isinstance(raw[key], bool)):
                raise ValueError(f"--speculative-config: {key} must be an integer")
        return cls(**raw)
