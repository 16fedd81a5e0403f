"""Sampler semantics on hand-made logits."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.sampler import Sampler
from pdserve.protocol.sampling import SamplingParams as SP

V = 12


def sample(logits, params, prompts=None, outputs=None, seed=0):
    n = len(params)
    return Sampler(eos_token_ids=[0], seed=seed)(logits, params, prompts or [[1]] * n, outputs or [[]] * n)


def test_greedy_fast_path_equals_argmax_and_leaves_logits_alone():
    logits = torch.randn(4, V)
    before = logits.clone()
    out = sample(logits, [SP(temperature=0)] * 4)
    assert out.token_ids == logits.argmax(-1).tolist() and out.logprobs == [None] * 4
    assert torch.equal(logits, before)
    slow = sample(logits, [SP(temperature=0, logprobs=0)] * 4)  # forces the full path
    assert slow.token_ids == out.token_ids


@pytest.mark.parametrize(
    "sp", [SP(temperature=1, top_k=1), SP(temperature=1, top_p=1e-6), SP(temperature=1, min_p=1.0)]
)
def test_degenerate_filters_are_greedy(sp):
    logits = torch.randn(8, V)
    assert sample(logits, [sp] * 8, seed=3).token_ids == logits.argmax(-1).tolist()


def test_seeded_rows_reproducible_across_batches_and_positions():
    torch.manual_seed(0)
    row = torch.randn(1, V)
    sp = SP(temperature=1.0, seed=42)
    alone = sample(row, [sp], outputs=[[3, 4]]).token_ids[0]
    batch = torch.cat([torch.randn(2, V), row, torch.randn(1, V)])
    params = [SP(temperature=1.0), SP(temperature=0), sp, SP(temperature=0.5, seed=7)]
    together = sample(batch, params, outputs=[[], [], [3, 4], []], seed=99).token_ids[2]
    assert alone == together
    draws = {sample(row, [SP(temperature=1.0, seed=s)]).token_ids[0] for s in range(40)}
    assert len(draws) > 3  # different seeds, different draws


def test_temperature_one_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().unsqueeze(0)
    counts = torch.zeros(4)
    s = Sampler([99], seed=1)
    for step in range(4000):
        counts[s(logits, [SP(temperature=1.0)], [[1]], [[]]).token_ids[0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)


def test_seeded_draws_follow_the_distribution_and_never_take_a_filtered_token():
    """Seeds draw by the inverse CDF too: over many seeds the frequencies are the probabilities,
    and a token top-k removed (probability 0, lying between kept ones in vocabulary order) never
    comes out."""
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    logits = probs.log().unsqueeze(0)
    counts, kept = torch.zeros(4), torch.zeros(4)
    for seed in range(4000):
        counts[sample(logits, [SP(temperature=1.0, seed=seed)]).token_ids[0]] += 1
        kept[sample(logits, [SP(temperature=1.0, top_k=2, seed=seed)]).token_ids[0]] += 1
    assert torch.allclose(counts / counts.sum(), probs, atol=0.03)
    assert kept[0] == 0 and kept[2] == 0
    assert abs(kept[1] / kept.sum() - 0.5 / 0.8) < 0.03


def test_penalties_change_the_choice():
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0] + [-5.0] * (V - 4)])
    assert sample(logits, [SP(temperature=0)]).token_ids == [1]
    # token 1 seen in the output: presence / frequency push it below token 2
    assert sample(logits, [SP(temperature=0, presence_penalty=0.5)], outputs=[[1]]).token_ids == [2]
    assert sample(logits, [SP(temperature=0, frequency_penalty=0.2)], outputs=[[1]]).token_ids == [2]
    assert sample(logits, [SP(temperature=0, frequency_penalty=0.2)], outputs=[[2]]).token_ids == [1]
    # repetition penalty (HF) also counts the prompt
    assert sample(logits, [SP(temperature=0, repetition_penalty=1.2)], prompts=[[1]]).token_ids == [2]


def test_min_tokens_suppresses_eos_and_stop_ids():
    logits = torch.tensor([[5.0, 1.0, 4.0] + [0.0] * (V - 3)])
    assert sample(logits, [SP(temperature=0, min_tokens=2)], outputs=[[]]).token_ids == [2]
    assert sample(logits, [SP(temperature=0, min_tokens=2, stop_token_ids=(2,))], outputs=[[]]).token_ids == [1]
    assert sample(logits, [SP(temperature=0, min_tokens=2)], outputs=[[7, 7]]).token_ids == [0]


def test_logprobs_are_raw_log_softmax_with_sorted_top_n():
    logits = torch.randn(2, V)
    out = sample(
        logits, [SP(temperature=0.7, seed=1, logprobs=3, presence_penalty=1.0), SP(temperature=0)], outputs=[[1], []]
    )
    lp = out.logprobs[0]
    ref = logits[0].log_softmax(-1)
    assert lp.token_id == out.token_ids[0] and lp.logprob == pytest.approx(float(ref[lp.token_id]))
    assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True) and len(lp.top_ids) == 3
    assert lp.top_ids[0] == int(ref.argmax())
    assert out.logprobs[1] is None


def test_sampling_params_reject_bad_values():
    for bad in (
        dict(max_tokens=0),
        dict(temperature=-1),
        dict(temperature=float("nan")),
        dict(top_p=0),
        dict(top_k=-2),
        dict(min_p=2),
        dict(logprobs=-1),
    ):
        with pytest.raises(ValueError):
            SP(**bad)


def test_logit_bias_moves_the_choice_and_not_the_reported_logprobs():
    torch.manual_seed(5)
    logits = torch.randn(3, V)
    top = logits.argmax(-1).tolist()
    pick = [(t + 3) % V for t in top]
    params = [
        SP(temperature=0, logit_bias=((pick[0], 100.0),)),  # forced
        SP(temperature=0, logit_bias=((top[1], -100.0),)),  # banned: the runner-up wins
        SP(temperature=0, logprobs=0),
    ]  # no bias in the same batch
    out = sample(logits, params)
    assert out.token_ids[0] == pick[0]
    assert out.token_ids[1] == logits[1].topk(2).indices[1].item()
    assert out.token_ids[2] == top[2]
    raw = torch.log_softmax(logits[2], -1)[top[2]].item()
    assert out.logprobs[2].logprob == pytest.approx(raw)  # reported from the raw distribution
    with pytest.raises(ValueError):
        SP(logit_bias=((1, 101.0),))
