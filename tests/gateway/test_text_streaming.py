"""Incremental detokenization and stop-string matching, property-style."""

from __future__ import annotations

import random

import pytest

from pdserve.gateway.detokenizer import IncrementalDetokenizer
from pdserve.gateway.stop_strings import StopMatcher

TEXTS = ["Hello wörld 🙂 日本語 the server", "🚀✨ emoji 🙂🙂 and ½ € mixed", "中文 한국어 русский café"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_equal_full_decode_and_never_split_a_character(tokenizer, text):
    ids = tokenizer.encode(text)
    assert len(ids) > len(text.split())  # byte-level pieces: multi-byte chars span tokens
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_random_token_streams_match_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(3, len(tokenizer)) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tokenizer)
        out = "".join(detok.add(t) for t in ids) + detok.flush()
        assert out == tokenizer.decode(ids, skip_special_tokens=True)


def test_stop_matcher_holds_back_partial_matches():
    m = StopMatcher(["STOP", "xyz"])
    assert m.feed("abc ST") == ("abc ", False)
    assert m.feed("O") == ("", False)
    assert m.feed("Pdef") == ("", True)  # "STOP" completed: nothing after it
    m = StopMatcher(["STOP"])
    assert m.feed("ST") == ("", False)
    assert m.feed("ay") == ("STay", False)  # released: cannot match any more
    assert m.flush() == ""


@pytest.mark.parametrize("split_seed", range(20))
def test_stop_matcher_any_split_equals_whole(split_seed):
    text, stops = "the quick brown fox jumps over the lazy dog", ["fox j", "lazy"]
    rng = random.Random(split_seed)
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    parts = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    m = StopMatcher(stops)
    out, hit = "", False
    for p in parts:
        piece, hit = m.feed(p)
        out += piece
        if hit:
            break
    assert hit and out == "the quick brown "
