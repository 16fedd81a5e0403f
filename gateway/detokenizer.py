"""Incremental detokenization: text deltas per new token, never splitting a character.

Byte-level BPE tokens can end inside a multi-byte UTF-8 character; decoding such a prefix
yields U+FFFD. We decode a small window [prefix_offset, end) and emit only once the window's
text grows without ending in U+FFFD; the window then slides forward. Where the decode is the
Rust tokenizer's (gateway/text_decoder.py), its `DecodeStream` runs this same logic in one call
per token, the prefix's text kept between calls; a step it refuses (a window whose text does not
start with the prefix's, which the logic here slices by length) is done here instead.
"""

from __future__ import annotations

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """`keep`: special token ids to keep as their text though special tokens are skipped (a
    tool-call format's markers, e.g. Mistral's `[TOOL_CALLS]`: gateway/tools/). `unrendered`: ids
    that stand for no text (a GGUF file's UNUSED tokens, as llama.cpp renders them)."""

    def __init__(
        self,
        tokenizer,
        skip_special_tokens: bool = True,
        keep: dict[int, str] | None = None,
        unrendered: frozenset[int] = frozenset(),
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.keep = keep or {}
        self.unrendered = unrendered
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start
        self.read_offset = 0  # tokens before this are already emitted
        make_stream = getattr(tokenizer, "stream", None)  # text_decoder's Rust decode
        self._stream = make_stream(skip_special_tokens) if make_stream is not None and not self.keep else None

    def _decode(self, ids: list[int]) -> str:
        if not self.keep or not any(i in self.keep for i in ids):
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
        out: list[str] = []  # the runs between kept markers decoded as usual, the markers as their text
        run: list[int] = []
        for i in ids:
            if i in self.keep:
                out += [self.tokenizer.decode(run, skip_special_tokens=self.skip_special), self.keep[i]]
                run = []
            else:
                run.append(i)
        out.append(self.tokenizer.decode(run, skip_special_tokens=self.skip_special))
        return "".join(out)

    def add(self, token_id: int) -> str:
        if token_id in self.unrendered:
            return ""
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                text = self._stream.step(self.tokenizer.backend, token_id)
            except Exception:  # its prefix check refused the window: the logic below from now on
                self._stream = None
            else:
                if text is None:
                    return ""
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                return text
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        if len(text) > len(prefix) and not text.endswith(_REPLACEMENT):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (at the end of a sequence)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        return text[len(prefix) :]
