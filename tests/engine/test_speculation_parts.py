"""Speculation's pure parts: the n-gram proposer, acceptance, the adaptive draft length, the
config's JSON (engine/spec/)."""

from __future__ import annotations

import pytest

from pdserve.engine.spec.adaptive import FIRST_PAUSE_STEPS, MISSES_TO_PAUSE, DraftLength
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.engine.spec.ngram import propose_ngram
from pdserve.engine.spec.verify import num_accepted


def test_ngram_proposes_what_followed_the_latest_match():
    #        0  1  2  3  4  5  6  7
    tokens = [1, 2, 3, 4, 9, 2, 3, 4]
    assert propose_ngram(tokens, 2, 1, 4) == [9, 2]
    # two earlier matches of the tail "7": the latest (at 3) wins
    assert propose_ngram([7, 1, 5, 7, 2, 8, 7], 2, 1, 1) == [2, 8]


def test_ngram_prefers_the_longest_tail():
    # tail "3" alone recurs last at 4 (-> 6); tail "2 3" recurs only at 1..2 (-> 5)
    assert propose_ngram([1, 2, 3, 5, 3, 6, 2, 3], 1, 1, 3) == [5]
    assert propose_ngram([1, 2, 3, 5, 3, 6, 2, 3], 1, 1, 1) == [6]


def test_ngram_loop_proposes_k_tokens_by_overlapping_copy():
    assert propose_ngram([5, 1, 2, 1, 2], 5, 1, 2) == [1, 2, 1, 2, 1]
    assert propose_ngram([4, 4], 3, 1, 4) == [4, 4, 4]


def test_ngram_without_a_match_or_room_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4], 3, 1, 4) == []
    assert propose_ngram([1, 2, 1, 2], 3, 3, 4) == []  # tails of 3+ tokens never recur
    assert propose_ngram([1], 3, 1, 4) == []
    assert propose_ngram([1, 1], 0, 1, 4) == []


def test_num_accepted_is_the_matching_prefix():
    assert num_accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert num_accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert num_accepted([5, 6, 7], [1, 6, 7, 8]) == 0
    assert num_accepted([5, 6], [5]) == 1  # (the sequence ended on the first emitted token)


def test_draft_length_follows_acceptance_and_pauses_after_misses():
    d = DraftLength(k_max=4)
    assert d.wanted() == 4
    d.observe(4, 4)
    assert d.wanted() == 4
    d.observe(4, 1)
    assert d.wanted() == 2  # accepted + 1
    for _ in range(MISSES_TO_PAUSE):
        d.observe(2, 0)
    assert [d.wanted() for _ in range(FIRST_PAUSE_STEPS)] == [0] * FIRST_PAUSE_STEPS
    assert d.wanted() == 1  # tries again with one draft
    for _ in range(MISSES_TO_PAUSE):
        d.observe(1, 0)
    assert [d.wanted() for _ in range(2 * FIRST_PAUSE_STEPS)] == [0] * (2 * FIRST_PAUSE_STEPS)  # twice as long
    d.wanted()
    d.observe(1, 1)  # a hit: back to growing, pauses start short again
    assert d.wanted() == 4 and d.next_pause == FIRST_PAUSE_STEPS


def test_config_from_vllm_json():
    cfg = SpeculativeConfig.from_json(
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    )
    assert (cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == (3, 4, 2)


@pytest.mark.parametrize(
    "text, error",
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"method": "medusa", "num_speculative_tokens": 2}', "method must be one of"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', 'needs "model"'),
        ('{"method": "ngram", "model": "/m", "num_speculative_tokens": 2}', 'needs method "draft_model"'),
        ('{"num_speculative_tokens": 2, "lookahead": 1}', "unknown keys"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be"),
        ('{"num_speculative_tokens": "2"}', "must be an integer"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
    ],
)
def test_config_refuses_bad_json_clearly(text, error):
    with pytest.raises(ValueError, match=error):
        SpeculativeConfig.from_json(text)
