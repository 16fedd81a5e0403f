"""The detokenizer's fast decode gives exactly the tokenizer's text, special tokens kept or
skipped, and is used only where transformers would not clean the text up afterwards."""

from __future__ import annotations

import random

from pdserve.gateway.detokenizer import IncrementalDetokenizer
from pdserve.gateway.text_decoder import text_decoder


def test_fast_decode_equals_the_tokenizers(tokenizer):
    fast = text_decoder(tokenizer)
    assert fast is not tokenizer  # a fast tokenizer without clean-up: the Rust decode is used
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 12))]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
    slow, quick = IncrementalDetokenizer(tokenizer), IncrementalDetokenizer(fast)
    assert [slow.add(t) for t in ids] + [slow.flush()] == [quick.add(t) for t in ids] + [quick.flush()]


def test_a_tokenizer_that_cleans_up_keeps_its_own_decode(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert text_decoder(tokenizer) is tokenizer
