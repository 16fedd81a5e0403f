"""Token ids to text on the token path, without transformers' per-call Python work.

The incremental detokenizer (gateway/detokenizer.py) decodes two short windows per output
token; through `PreTrainedTokenizerFast.decode` each call converts its arguments, dispatches and
checks clean-up options before the Rust tokenizer's own `decode` runs, several times the cost of
that decode. `text_decoder` hands the detokenizer the Rust tokenizer's `decode` where it gives
the same text: a fast tokenizer with `clean_up_tokenization_spaces` off; else the tokenizer
itself.
"""

from __future__ import annotations

from typing import Any


class _BackendDecode:
    __slots__ = ("decode",)

    def __init__(self, backend: Any) -> None:
        self.decode = backend.decode  # (ids, skip_special_tokens=...) -> str


def text_decoder(tokenizer: Any) -> Any:
    """An object whose `decode(ids, skip_special_tokens=...)` equals `tokenizer.decode`'s."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not hasattr(backend, "decode"):
        return tokenizer  # a slow (Python) tokenizer: its own decode
    if getattr(tokenizer, "clean_up_tokenization_spaces", True):  # transformers may clean the text up
        return tokenizer
    return _BackendDecode(backend)
