"""Grammar libraries for constrained decoding, measured on this machine: xgrammar vs llguidance.

`python -m pdserve.bench.structured_output [--vocab 512 49152]` builds a tokenizer of each size
(modelgen/tokenizer_builder.py, the tokenizer `make_model` gives its models), then per library:
  - tokenizer: building the library's tokenizer view (once per worker);
  - compile: a schema (or regex) to a ready matcher, first mask included, no cache;
  - mask: filling the next-token bitmask per decode step, for batch 1 and 32 (every row its
    own matcher), walking the tokens of a valid document; and applying it to [B, V] logits;
  - compile p50/p99: every schema of bench/real_world_schemas.py compiled --compile-repeats
    times, no cache (the distribution over schemas x repeats).
Figures go to stdout as a markdown table (docs/benchmarks/structured_output.md holds a run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.machine import best_of
from pdserve.bench.real_world_schemas import REAL_WORLD_SCHEMAS
from pdserve.engine.structured.bitmask import apply_bitmask
from pdserve.modelgen.tokenizer_builder import EOS, build_tokenizer

# (name, JSON schema, a document it accepts)
SCHEMAS: list[tuple[str, dict[str, Any], Any]] = [
    (
        "nested objects",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "address": {
                    "type": "object",
                    "properties": {"street": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"],
                },
            },
            "required": ["name", "address"],
        },
        {"name": "the server", "address": {"street": "one model lane", "zip": "12345"}},
    ),
    (
        "array + enum + bounds",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": {
                        "type": "object",
                        "properties": {
                            "kind": {"enum": ["prefill", "decode", "cache"]},
                            "score": {"type": "integer", "minimum": 0, "maximum": 100},
                            "label": {"type": "string", "minLength": 2, "maxLength": 12},
                        },
                        "required": ["kind", "score", "label"],
                    },
                },
            },
            "required": ["items"],
        },
        {"items": [{"kind": "decode", "score": 42, "label": "batch"}, {"kind": "cache", "score": 7, "label": "ok"}]},
    ),
    (
        "additionalProperties false",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "ok": {"type": "boolean"},
                "ratio": {"type": "number"},
            },
            "required": ["id", "tags", "ok", "ratio"],
            "additionalProperties": False,
        },
        {"id": 17, "tags": ["token", "stream"], "ok": True, "ratio": 0.25},
    ),
]
REGEX = ("regex (date)", r"[0-9]{4}-[0-9]{2}-[0-9]{2}", "2024-05-17")


class Xgr:
    name = "xgrammar"

    def __init__(self, folder: Path, vocab: int) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self.xgr = xgr
        hf = AutoTokenizer.from_pretrained(folder)
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.tokenizer_s = time.perf_counter() - t0
        self.vocab = vocab

    def compile(self, kind: str, spec: Any) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json":
            return compiler.compile_json_schema(json.dumps(spec))
        return compiler.compile_regex(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.xgr.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matchers: list[Any], mask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        apply_bitmask(logits, mask)  # the engine's, for both: only the mask fill differs


class Llg:
    name = "llguidance"

    def __init__(self, folder: Path, vocab: int) -> None:
        import llguidance
        import llguidance.torch

        self.llg, self.lt = llguidance, llguidance.torch
        text = (folder / "tokenizer.json").read_text()
        eos = json.loads(text)["added_tokens"][0]
        assert eos["content"] == EOS
        t0 = time.perf_counter()
        self.tok = llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=eos["id"])
        self.tokenizer_s = time.perf_counter() - t0
        self.vocab = vocab

    def compile(self, kind: str, spec: Any) -> Any:
        m = self.llg.LLMatcher
        grammar = m.grammar_from_json_schema(spec) if kind == "json" else m.grammar_from_regex(spec)
        matcher = m(self.tok, grammar)
        mask = self.bitmask(1)
        self.lt.fill_next_token_bitmask(matcher, mask, 0)  # the lexer/parser build lazily: first mask counts
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, compiled: Any) -> Any:
        return self.llg.LLMatcher(self.tok, compiled)

    def bitmask(self, batch: int) -> torch.Tensor:
        return self.lt.allocate_token_bitmask(batch, self.vocab)

    def fill(self, matchers: list[Any], mask: torch.Tensor) -> None:
        # one row after another: its thread pool (fill_next_token_bitmask_par) ran 3-10x slower
        # than this loop on 2 busy cores
        for i, m in enumerate(matchers):
            self.lt.fill_next_token_bitmask(m, mask, i)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def apply(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        apply_bitmask(logits, mask)  # llguidance.torch's took 8-13 ms at B=32, V=512 here


def _walk(lib: Any, compiled: Any, tokens: list[int], batch: int) -> tuple[float, float]:
    """Median seconds per decode step: fill the [batch] masks, then apply them to logits."""
    matchers = [lib.matcher(compiled) for _ in range(batch)]
    mask = lib.bitmask(batch)  # [B, ceil(V / 32)] int32
    logits = torch.randn(batch, lib.vocab)  # [B, V]
    fills, applies = [], []
    for t in tokens:
        t0 = time.perf_counter()
        lib.fill(matchers, mask)
        t1 = time.perf_counter()
        lib.apply(logits, mask)
        t2 = time.perf_counter()
        fills.append(t1 - t0)
        applies.append(t2 - t1)
        for m in matchers:
            assert lib.accept(m, t), f"{lib.name} refused token {t}"
    return statistics.median(fills), statistics.median(applies)


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def compile_rows(lib: Any, repeats: int) -> list[str]:
    """Compile time over the real-world schemas: p50, p99, the slowest schema."""
    times: list[float] = []
    slowest: tuple[float, str] = (0.0, "")
    for name, schema in REAL_WORLD_SCHEMAS:
        for _ in range(repeats):
            t0 = time.perf_counter()
            lib.compile("json", schema)
            dt = time.perf_counter() - t0
            times.append(dt)
            slowest = max(slowest, (dt, name))
    return [
        f"| {lib.name} | {len(REAL_WORLD_SCHEMAS)} real-world schemas x {repeats} | {_percentile(times, 0.5) * 1e3:.2f}"
        f" | {_percentile(times, 0.99) * 1e3:.2f} | {slowest[0] * 1e3:.2f} ({slowest[1]}) |"
    ]


def run(vocab: int, compile_repeats: int = 5) -> list[str]:
    from tokenizers import Tokenizer

    folder = Path(tempfile.mkdtemp(prefix=f"so-bench-{vocab}-"))
    t0 = time.perf_counter()
    real_vocab = build_tokenizer(folder, vocab)
    built = time.perf_counter() - t0
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    rows = [f"\n### vocab {real_vocab} (BPE built in {built:.1f} s)\n"]
    rows.append(
        "| library | case | tokenizer view ms | compile ms | mask B=1 us/step | mask B=32 us/step | apply B=32 us |"
    )
    rows.append("|---|---|---|---|---|---|---|")
    cases: list[tuple[str, str, Any, str]] = [
        (n, "json", s, json.dumps(doc, separators=(",", ":"))) for n, s, doc in SCHEMAS
    ]
    cases.append((REGEX[0], "regex", REGEX[1], REGEX[2]))
    compiles = ["", "| library | schemas | compile p50 ms | p99 ms | slowest ms |", "|---|---|---|---|---|"]
    for cls in (Xgr, Llg):
        try:
            lib = cls(folder, real_vocab)
        except ImportError:  # xgrammar is not a dependency: installed by hand to compare
            rows.append(f"| {cls.name} | not installed (`pip install {cls.name}`) | | | | | |")
            continue
        compiles += compile_rows(lib, compile_repeats)
        for name, kind, spec, text in cases:
            compile_s = best_of(lambda: lib.compile(kind, spec), 3)
            compiled = lib.compile(kind, spec)
            tokens = tok.encode(text).ids
            b1, _ = _walk(lib, compiled, tokens, 1)
            b32, apply32 = _walk(lib, compiled, tokens, 32)
            rows.append(
                f"| {lib.name} | {name} | {lib.tokenizer_s * 1e3:.0f} | {compile_s * 1e3:.2f}"
                f" | {b1 * 1e6:.0f} | {b32 * 1e6:.0f} | {apply32 * 1e6:.0f} |"
            )
    return rows + compiles


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 49152 asked: the synthetic corpus gives BPE ~14.6k merges at most (the size reported)
    ap.add_argument("--vocab", type=int, nargs="+", default=[512, 49152])
    ap.add_argument("--compile-repeats", type=int, default=5, help="compiles of each real-world schema")
    args = ap.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for v in args.vocab:
        print("\n".join(run(v, args.compile_repeats)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
