"""One grammar matcher per constrained sequence, and the engine's compile cache.

llguidance builds a grammar's lexer and parser lazily, so a "compile" is a matcher plus its first
mask: 0.4-0.8 ms for the schemas of docs/benchmarks/structured_output.md on this CPU. It runs
synchronously at add_request (no compile thread); the cache keeps one pristine matcher per
(kind, spec) and every sequence deep-copies it, sharing what was built.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import llguidance
import llguidance.torch as llg_torch
import torch

from pdserve.engine.structured.bitmask import allocate_bitmask, apply_bitmask
from pdserve.engine.structured.grammar import grammar_of
from pdserve.protocol.sampling import StructuredOutput


class TokenizerLoad:
    """The model's Hugging Face tokenizer, loaded in a thread from now on: importing transformers
    and loading a 49k vocabulary take seconds (5-12 s on a loaded 2-core machine). A worker starts
    it before loading its model, so both loads overlap, and hands it to its engine's GrammarCache
    (`warm_in_background`)."""

    def __init__(self, model: str | Path) -> None:
        # transformers' first import, here on the caller's thread (~1 s): two threads importing it
        # at once fail in one of them ("cannot import name 'AutoConfig' from 'transformers'",
        # transformers 5.24), and the caller may load a model through transformers meanwhile.
        # Its names stay lazy; resolving them from two threads after this import is safe.
        import transformers  # noqa: F401

        self.model = str(model)
        self._tokenizer: object = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._load, name="tokenizer-load", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            from pdserve.engine.gguf_file import load_tokenizer

            self._tokenizer = load_tokenizer(self.model)
        except BaseException as e:  # (no tokenizer files, say): raised to whoever asks for it
            self._error = e

    def result(self) -> object:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._tokenizer


class Grammar:
    """A sequence's matcher: which tokens may come next; advanced with each accepted token."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._m = matcher

    def accept(self, token: int) -> bool:
        """Consume a sampled token; False when the grammar refuses it (the matcher is then dead)."""
        return self._m.consume_token(token)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading `tokens` the grammar would accept in a row (nothing is consumed)."""
        return self._m.validate_tokens(tokens)

    @property
    def terminated(self) -> bool:
        """Nothing may follow: the sequence ends here."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()

    def fork(self) -> Grammar:
        return Grammar(self._m.deep_copy())

    def fill(self, mask: torch.Tensor, row: int) -> None:
        """mask [R, ceil(V / 32)] int32: row `row` <- the tokens allowed next."""
        llg_torch.fill_next_token_bitmask(self._m, mask, row)


class GrammarCache:
    """(kind, spec) -> a compiled matcher at its start; LRU of `max_entries`. The llguidance
    tokenizer (the model's vocabulary: loading the HF tokenizer takes seconds) is built at the
    first constraint, or ahead of it by `warm_in_background` (workers do at start)."""

    def __init__(self, model: str | Path, vocab_size: int, eos_token_ids: Sequence[int], max_entries: int = 256):
        self.model, self.vocab_size, self.eos = str(model), vocab_size, list(eos_token_ids)
        self.max_entries = max_entries
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._warming: threading.Thread | None = None  # warm_in_background's build
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self.mask_stats = MaskStats()  # the engine's masking cost (constrain(..., stats=))

    def warm_in_background(self, loading: TokenizerLoad | None = None) -> None:
        """Build the llguidance tokenizer now, in a thread (from `loading`, a load already under
        way, if given), instead of at the first constraint: loading the model's tokenizer through
        transformers takes seconds, which a worker's loop would otherwise spend inside its first
        constrained request (a decode worker's reservation answered that late timed out at the
        gateway: docs/reliability.md). Workers call it at start; a failure here is left for the
        first constraint to raise."""
        if self._tokenizer is not None or self._warming is not None:
            return
        self._warming = threading.Thread(target=self._warm, args=(loading,), name="grammar-tokenizer", daemon=True)
        self._warming.start()

    def _warm(self, loading: TokenizerLoad | None) -> None:
        try:
            self._tokenizer = self._build_tokenizer(loading.result() if loading is not None else None)
        except Exception:  # (no tokenizer files, say): the first constraint builds it again and raises
            pass

    def _build_tokenizer(self, hf: object = None) -> llguidance.LLTokenizer:
        import llguidance.hf

        from pdserve.engine.gguf_file import load_tokenizer

        if hf is None:
            hf = load_tokenizer(self.model)
        return llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=self.eos)  # type: ignore[arg-type]

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        if self._tokenizer is None and self._warming is not None:
            self._warming.join()  # (the rest of its build, if it has not finished)
        if self._tokenizer is None:
            self._tokenizer = self._build_tokenizer()
        return self._tokenizer

    def new(self, c: StructuredOutput) -> Grammar:
        """A fresh matcher for one sequence; ValueError when the constraint does not compile."""
        key = (c.kind, c.spec)
        start = self._cache.get(key)
        if start is None:
            start = llguidance.LLMatcher(self._llg_tokenizer(), grammar_of(c), log_level=0)
            if start.is_error():
                raise ValueError(f"invalid {c.kind.replace('_', ' ')}: {start.get_error().strip()}")
            self._cache[key] = start
            if len(self._cache) > self.max_entries:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return Grammar(start.deep_copy())


@dataclass
class MaskStats:
    """What masking cost this engine (totals): rows masked, and the seconds spent filling and
    applying their bitmasks; shipped in heartbeats (`WorkerStats.structured_mask_*`)."""

    rows: int = 0
    seconds: float = 0.0


def constrain(logits: torch.Tensor, grammars: Sequence[Grammar | None], stats: MaskStats | None = None) -> None:
    """logits [R, V] in place: each constrained row keeps only the tokens its grammar allows."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return
    t0 = time.perf_counter()
    _mask_rows(logits, grammars, rows)
    if stats is not None:
        stats.rows += len(rows)
        stats.seconds += time.perf_counter() - t0


def _mask_rows(logits: torch.Tensor, grammars: Sequence[Grammar | None], rows: list[int]) -> None:
    mask = allocate_bitmask(len(rows), logits.shape[1])  # [C, ceil(V / 32)]
    for r, i in enumerate(rows):
        grammar = grammars[i]
        assert grammar is not None
        grammar.fill(mask, r)
    if len(rows) == logits.shape[0]:
        apply_bitmask(logits, mask)
        return
    index = torch.tensor(rows)
    sub = logits[index]  # [C, V]
    apply_bitmask(sub, mask)
    logits[index] = sub
