"""Benchmark prompts: random (exact token lengths), ShareGPT, or JSONL."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


def uniform_lengths(rng, n: int, mean: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return rng.integers(lo, hi + 1, size=n).tolist()


def random_requests(
    tokenizer,
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    tokenized: bool = False,
) -> list[BenchRequest]:
    """Prompts of exactly the drawn token length (text that re-tokenizes to it, or raw ids)."""
    rng = np.random.default_rng(seed)
    special = set(tokenizer.all_special_ids)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    prefix = rng.choice(vocab, size=prefix_len).tolist() if prefix_len else []
    out = []
    for in_len, out_len in zip(
        uniform_lengths(rng, n, input_len, range_ratio), uniform_lengths(rng, n, output_len, range_ratio)
    ):
        ids = prefix + rng.choice(vocab, size=in_len).tolist()
        if tokenized:
            out.append(BenchRequest(ids, len(ids), out_len))
            continue
        target = len(ids)
        for _ in range(10):  # decode/encode until stable at the target length
            text = tokenizer.decode(ids)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == target:
                break
            ids = (ids + rng.choice(vocab, size=target).tolist())[:target]
        text = tokenizer.decode(ids)
        out.append(BenchRequest(text, len(tokenizer.encode(text, add_special_tokens=False)), out_len))
    return out


def sharegpt_requests(tokenizer, path: str, n: int, seed: int = 0, output_len: int | None = None) -> list[BenchRequest]:
    data = json.loads(Path(path).read_text())
    rng = np.random.default_rng(seed)
    convs = [d["conversations"] for d in data if len(d.get("conversations", [])) >= 2]
    rng.shuffle(convs)
    out = []
    for conv in convs:
        prompt, answer = conv[0]["value"], conv[1]["value"]
        p_len = len(tokenizer.encode(prompt))
        o_len = output_len or len(tokenizer.encode(answer))
        if p_len < 4 or o_len < 4:
            continue
        out.append(BenchRequest(prompt, p_len, o_len))
        if len(out) == n:
            break
    return out


def jsonl_requests(tokenizer, path: str, n: int, default_output_len: int = 128) -> list[BenchRequest]:
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        out.append(
            BenchRequest(
                row["prompt"], len(tokenizer.encode(row["prompt"])), int(row.get("output_len", default_output_len))
            )
        )
        if len(out) == n:
            break
    return out
