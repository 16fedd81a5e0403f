"""The batch-aware gate on speculation (engine/measured_choice.py): measured seconds per emitted token
of speculating and plain decode steps, per batch-size bucket, with periodic exploration."""

from pdserve.engine.measured_choice import FIRST_EXPLORE, MAX_EXPLORE, MIN_SAMPLES, MeasuredChoice, bucket_of


def _run(payoff: MeasuredChoice, batch: int, spec_cost: float, plain_cost: float, steps: int) -> list[bool]:
    """`steps` decisions at `batch`, each fed back with its kind's seconds per token."""
    choices = []
    for _ in range(steps):
        spec = payoff.allow(batch)
        choices.append(spec)
        payoff.observe(batch, spec, (spec_cost if spec else plain_cost) * batch, batch)
    return choices


def test_buckets_are_powers_of_two():
    assert [bucket_of(n) for n in (1, 2, 3, 4, 7, 8, 16, 31, 32)] == [0, 1, 1, 2, 2, 3, 4, 4, 5]


def test_speculation_that_loses_in_a_full_batch_is_turned_off_there_only():
    p = MeasuredChoice()
    full = _run(p, 16, spec_cost=1.5, plain_cost=1.0, steps=160)
    lone = _run(p, 1, spec_cost=0.4, plain_cost=1.0, steps=160)
    settled_full, settled_lone = full[2 * MIN_SAMPLES + 2 :], lone[2 * MIN_SAMPLES + 2 :]
    # at 16 sequences only the exploring steps speculate, fewer and fewer; alone, nearly every step does
    assert sum(settled_full) <= len(settled_full) // FIRST_EXPLORE + 1
    assert sum(settled_lone) >= len(settled_lone) - len(settled_lone) // FIRST_EXPLORE - 1


def test_explorations_thin_out_while_they_confirm_the_choice():
    p = MeasuredChoice()
    steps = _run(p, 16, spec_cost=3.0, plain_cost=1.0, steps=2000)
    explored = [i for i, spec in enumerate(steps) if spec][MIN_SAMPLES:]
    gaps = [b - a for a, b in zip(explored, explored[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == MAX_EXPLORE


def test_both_kinds_are_measured_before_the_figures_decide():
    p = MeasuredChoice()
    first = _run(p, 4, spec_cost=9.0, plain_cost=1.0, steps=2 * MIN_SAMPLES)
    assert first == [True] * MIN_SAMPLES + [False] * MIN_SAMPLES


def test_a_change_in_acceptance_is_followed():
    """Exploration keeps the losing side's figure current: when drafts start paying, speculation
    comes back within a few explorations."""
    p = MeasuredChoice()
    _run(p, 8, spec_cost=2.0, plain_cost=1.0, steps=64)
    later = _run(p, 8, spec_cost=0.5, plain_cost=1.0, steps=512)
    assert sum(later[: FIRST_EXPLORE - 1]) <= 1  # still off at first
    assert sum(later[-64:]) >= 64 - 64 // FIRST_EXPLORE  # on again, but for plain explorations


def test_steps_without_tokens_are_ignored():
    p = MeasuredChoice()
    p.observe(2, True, 0.1, 0)
    p.observe(2, False, 0.0, 3)
    assert 1 not in p.buckets
