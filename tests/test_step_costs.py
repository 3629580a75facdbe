"""The speculative engine's step costs (decoding/costs.py): priced in plain steps, so a slowdown of the whole
machine cancels out; an outlier moves no estimate; sizes never measured read the curve through those that were,
and sizes beyond them are priced to be tried."""

from __future__ import annotations

import math

from m2r2_mlx.decoding.costs import StepCosts


def steady(costs: StepCosts, plain: float, verify: dict[int, float], steps: int = 9) -> None:
    """``steps`` plain steps of ``plain`` seconds, each followed by a verification of every size in ``verify``."""
    for _ in range(steps):
        costs.observe_plain(plain)
        for n, seconds in verify.items():
            costs.observe_verify(n, seconds)


def test_a_slowdown_of_the_whole_machine_cancels_out():
    costs = StepCosts()
    steady(costs, 0.050, {4: 0.060})
    assert math.isclose(costs.ratio(4), 1.2)
    steady(costs, 0.250, {4: 0.300})  # five times slower: both the plain step and the verification
    assert math.isclose(costs.ratio(4), 1.2) and math.isclose(costs.plain_seconds(), 0.250)


def test_an_outlier_does_not_move_an_estimate_and_a_stretch_of_them_is_replaced():
    costs = StepCosts()
    steady(costs, 0.050, {2: 0.055})
    costs.observe_verify(2, 1.655)  # one verification while the machine was busy
    assert math.isclose(costs.ratio(2), 1.1)  # the median of the latest few
    steady(costs, 0.050, {2: 1.655}, steps=5)  # a whole stretch of them
    assert costs.ratio(2) > 30
    steady(costs, 0.050, {2: 0.055}, steps=5)  # the machine is quiet again: the latest samples win
    assert math.isclose(costs.ratio(2), 1.1)


def test_the_first_measurements_price_every_size():
    costs = StepCosts(draft_fraction=0.2)
    assert 1.0 < costs.ratio(4) < 1.2 and math.isclose(costs.draft_cost(), 0.2 * costs.plain_seconds())
    steady(costs, 0.040, {2: 0.060, 8: 0.120})
    costs.observe_draft(0.010)
    assert math.isclose(costs.ratio(2), 1.5) and math.isclose(costs.ratio(8), 3.0)
    assert math.isclose(costs.ratio(5), 2.25) and math.isclose(costs.draft_cost(), 0.010)
    assert math.isclose(costs.ratio(1), 1.0) and costs.ratio(16) >= costs.ratio(8)  # never falling beyond


def test_a_steep_small_size_does_not_price_longer_verifications_out_of_reach():
    """Two noisy samples of the smallest size set no slope for sizes never verified: those are priced low enough to
    be tried (and then by their own samples). Extending the end segment read 2-position verifications at 1.5 plain
    steps as 11 positions at 6, and an engine whose first answer drafted nothing never copied a passage after it."""
    costs = StepCosts()
    steady(costs, 0.040, {2: 0.060}, steps=2)
    assert math.isclose(costs.ratio(2), 1.5) and costs.ratio(11) < 2.5
    steady(costs, 0.040, {11: 0.200}, steps=2)  # measured: the size's own samples price it
    assert math.isclose(costs.ratio(11), 5.0) and math.isclose(costs.ratio(5), 1.5 + 3.5 * 3 / 9)


def test_steps_timed_before_any_plain_step_wait_for_one():
    """A conversation that opens with drafting (a copied passage) times verifications before any plain step: they
    are priced against the first plain step timed, not a guessed one (a fast device would read every verification
    as free, a slow one as dear, for a whole window of samples)."""
    costs = StepCosts(draft_fraction=0.2)
    for _ in range(3):
        costs.observe_verify(4, 0.0135)  # a device whose plain step is 5.9 ms: verifying 4 positions is 2.29 of it
        costs.observe_draft(0.0015)
    assert not costs.samples and 1.0 < costs.ratio(4) < 1.2  # the prior curve until a plain step is timed
    costs.observe_plain(0.0059)
    assert math.isclose(costs.ratio(4), 0.0135 / 0.0059) and math.isclose(costs.draft_cost(), 0.0015)
