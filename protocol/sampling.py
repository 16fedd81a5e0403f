"""Per-request sampling parameters: one typed struct the gateway, prefill and decode share.

Plain msgspec (no torch import) so the gateway can build it cheaply and it crosses sockets as
msgpack. Validation of user input happens at the gateway; `__post_init__` only guards internal
invariants so a bad struct never reaches the sampler.
"""

from __future__ import annotations

from typing import Literal, Union

import msgspec

StructuredKind = Literal["json_schema", "json_object", "regex", "choice", "grammar", "lark", "llguidance"]


class StructuredOutput(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A constraint on a request's output text (engine/structured/): the engine masks every
    token the grammar does not allow and ends the sequence ("stop") once the grammar is done."""

    kind: StructuredKind
    # json_schema: the schema as JSON text; json_object: ""; regex: the pattern (whole output);
    # choice: a JSON list of the allowed strings; grammar: Lark (or GBNF with `::=`); lark: an
    # llguidance Lark grammar as is (the gateway's own, e.g. a forced tool call's: gateway/tools/);
    # llguidance: llguidance's grammar list (JSON) as is (a constraint after reasoning: grammar.py)
    spec: str
    # a migrated request's prompt ends with this many tokens generated under the constraint:
    # the matcher consumes them before its first new token
    resumed_tokens: int = 0


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
    # None: none; K >= 0: every prompt token's logprob, rank and top-K (echo, vLLM's prompt_logprobs),
    # from the prefill's logits at every prompt position: such a prompt takes no prefix-cache reuse
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits (OpenAI)
    # Several sequences from one prompt (engine/sequence_group.py): one prefill, one transfer.
    n: int = 1  # sequences returned
    best_of: int | None = None  # sequences generated (>= n); the n with the highest cumulative logprob return
    use_beam_search: bool = False  # width best_of (or n); deterministic: temperature etc. do not apply
    length_penalty: float = 1.0  # beam score = sum logprob / generated_len ** length_penalty (HF)
    early_stopping: Union[bool, Literal["never"]] = False  # HF's beam stopping rule
    structured: StructuredOutput | None = None  # constrained decoding (response_format, guided_*)
    # vLLM's `priority` (lower first), resolved by the gateway from the request or its API key: it
    # orders every pool's waiting queue and picks who is preempted (engine/scheduler.py)
    priority: int = 0

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
        if self.prompt_logprobs is not None and (self.prompt_logprobs < 0 or self.use_beam_search):
            raise ValueError("prompt_logprobs must be >= 0, and beam search takes none")
        if any(t < 0 or not -100.0 <= b <= 100.0 for t, b in self.logit_bias):
            raise ValueError("logit_bias needs token ids >= 0 and biases in [-100, 100]")
        if self.n < 1 or (self.best_of is not None and self.best_of < self.n):
            raise ValueError("n must be >= 1 and best_of >= n")
        if self.use_beam_search and (self.uses_penalties or self.logprobs is not None):
            raise ValueError("beam search takes no penalties, logit_bias or logprobs")
        if self.use_beam_search and self.structured is not None:
            raise ValueError("beam search takes no structured output constraint")
        if self.structured is not None and self.structured.resumed_tokens < 0:
            raise ValueError("structured.resumed_tokens must be >= 0")

    @property
    def num_seqs(self) -> int:
        """Sequences generated: the beam width, or best_of, or n."""
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_group(self) -> bool:
        """More than one sequence, or a beam search: the engine runs a SequenceGroup."""
        return self.num_seqs > 1 or self.use_beam_search

    def worst_case_blocks(self, prompt_len: int, block_size: int) -> int:
        """KV blocks its sequences hold at full length: the prompt's full blocks once (shared),
        then each sequence's own from the partly filled one on."""
        tail = -(-(prompt_len % block_size + self.max_tokens) // block_size)
        return prompt_len // block_size + self.num_seqs * tail

    @property
    def streams_choices(self) -> bool:
        """Each choice's tokens go out as they come (else all at once when the group ends)."""
        return not self.use_beam_search and self.num_seqs == self.n

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
