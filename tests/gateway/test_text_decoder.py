"""The detokenizer's fast decode gives exactly the tokenizer's text, special tokens kept or
skipped, and is used only where transformers would not clean the text up afterwards."""

from __future__ import annotations

import random

import pytest

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
    assert quick._stream is not None  # the Rust DecodeStream steps it
    assert [slow.add(t) for t in ids] + [slow.flush()] == [quick.add(t) for t in ids] + [quick.flush()]


@pytest.mark.parametrize("skip", [True, False])
def test_the_rust_stream_gives_the_pieces_of_the_python_window(tokenizer, skip):
    fast = text_decoder(tokenizer)
    rng = random.Random(1)
    texts = ["Hello wörld 🙂 日本語 the server", "🚀✨ emoji 🙂🙂 and ½ € mixed"]
    streams = [tokenizer.encode(t) for t in texts] + [
        [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 60))] for _ in range(100)
    ]
    for ids in streams:
        slow, quick = IncrementalDetokenizer(tokenizer, skip), IncrementalDetokenizer(fast, skip)
        assert [slow.add(t) for t in ids] + [slow.flush()] == [quick.add(t) for t in ids] + [quick.flush()]


def test_a_step_the_rust_stream_refuses_is_done_by_the_python_window(tokenizer):
    class Refusing:
        calls = 0

        def step(self, backend, token_id):
            Refusing.calls += 1
            if Refusing.calls == 5:
                raise RuntimeError("invalid prefix")
            return real.step(backend, token_id)

    ids = tokenizer.encode("Hello wörld 🙂 日本語 the server, streamed")
    fast = text_decoder(tokenizer)
    quick = IncrementalDetokenizer(fast)
    real, quick._stream = quick._stream, Refusing()
    pieces = [quick.add(t) for t in ids] + [quick.flush()]
    assert Refusing.calls == 5 and quick._stream is None  # the Python window took over at step 5
    slow = IncrementalDetokenizer(tokenizer)
    assert pieces == [slow.add(t) for t in ids] + [slow.flush()]


def test_a_tokenizer_that_cleans_up_keeps_its_own_decode(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    assert text_decoder(tokenizer) is tokenizer
