"""Token ids to text on the token path, without transformers' per-call Python work.

The incremental detokenizer (gateway/detokenizer.py) decodes two short windows per output
token; through `PreTrainedTokenizerFast.decode` each call converts its arguments, dispatches and
checks clean-up options before the Rust tokenizer's own `decode` runs, several times the cost of
that decode. `text_decoder` hands the detokenizer the Rust tokenizer's `decode` (and its
streaming decoder, which runs the same window logic in one call) where it gives the same text: a
fast tokenizer with `clean_up_tokenization_spaces` off; else the tokenizer itself.
"""

from __future__ import annotations

from typing import Any

from tokenizers import decoders

_DecodeStream = getattr(decoders, "DecodeStream", None)  # tokenizers >= 0.21


class _BackendDecode:
    """The Rust tokenizer's `decode`, and its `DecodeStream` (one call per token, the window
    logic in Rust) for the detokenizer."""

    __slots__ = ("decode", "backend")

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.decode = backend.decode  # (ids, skip_special_tokens=...) -> str

    def stream(self, skip_special_tokens: bool) -> Any:
        """A fresh `DecodeStream`, or None where this tokenizers release has none."""
        return None if _DecodeStream is None else _DecodeStream(skip_special_tokens=skip_special_tokens)


def text_decoder(tokenizer: Any) -> Any:
    """An object whose `decode(ids, skip_special_tokens=...)` equals `tokenizer.decode`'s."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return tokenizer  # a slow (Python) tokenizer: its own decode
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):  # transformers may clean the text up
        return tokenizer
    return _BackendDecode(backend)


def special_markers(tokenizer: Any, markers: tuple[str, ...]) -> dict[int, str]:
    """id -> text of each of `markers` the tokenizer holds as one special token (which decoding
    with skip_special_tokens would drop); markers it spells as ordinary text need nothing."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    added = {t.content: i for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if t.special}
    out = {}
    for m in markers:
        i = added.get(m)
        if i is None and m in getattr(tokenizer, "all_special_tokens", ()):
            i = tokenizer.convert_tokens_to_ids(m)
        if i is not None and (i in special or m in added):
            out[i] = m
    return out
