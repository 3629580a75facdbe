"""The speculative engine's step costs (decoding/costs.py): priced in plain steps, so a slowdown of the whole
machine cancels out; no estimate outlives what it was measured in; sizes never measured read the calibration."""

from __future__ import annotations

import math

from m2r2_mlx.decoding.costs import Calibration, StepCosts, measure_calibration

PROFILE = Calibration(0.050, {2: 1.05, 4: 1.12, 8: 1.3, 16: 1.7})


def steady(costs: StepCosts, plain: float, verify: dict[int, float], steps: int = 9) -> None:
    """``steps`` plain steps of ``plain`` seconds, each followed by a verification of every size in ``verify``."""
    for _ in range(steps):
        costs.observe_plain(plain)
        for n, seconds in verify.items():
            costs.observe_verify(n, seconds)
        costs.tick()


def test_a_slowdown_of_the_whole_machine_cancels_out():
    costs = StepCosts(PROFILE)
    steady(costs, 0.050, {4: 0.060})
    assert math.isclose(costs.ratio(4), 1.2)
    steady(costs, 0.250, {4: 0.300})  # five times slower: both the plain step and the verification
    assert math.isclose(costs.ratio(4), 1.2) and math.isclose(costs.plain_seconds(), 0.250)


def test_an_outlier_neither_moves_an_estimate_far_nor_for_long():
    costs = StepCosts(PROFILE, max_age=64)
    steady(costs, 0.050, {2: 0.055})
    costs.observe_verify(2, 1.655)  # one verification while the machine was busy
    assert math.isclose(costs.ratio(2), 1.1)  # the median of the latest few
    costs = StepCosts(PROFILE, max_age=64)
    steady(costs, 0.050, {2: 1.655}, steps=5)  # a whole stretch of them
    assert costs.ratio(2) > 30
    for _ in range(65):  # then no verification of that size, only plain steps
        costs.observe_plain(0.050)
        costs.tick()
    assert math.isclose(costs.ratio(2), 1.05)  # aged out: the calibrated curve again


def test_sizes_not_measured_read_the_calibrated_curve_scaled_by_those_that_were():
    costs = StepCosts(PROFILE)
    assert math.isclose(costs.ratio(3), (1.05 + 1.12) / 2)  # between calibrated sizes
    steady(costs, 0.050, {4: 0.050 * 1.12 * 1.5})  # a whole step costs 1.5x the bare forward calibrated
    assert math.isclose(costs.ratio(4), 1.12 * 1.5) and math.isclose(costs.ratio(8), 1.3 * 1.5)
    assert math.isclose(costs.ratio(1), 1.0) and costs.ratio(32) >= costs.ratio(16)  # never falling beyond


def test_without_a_profile_the_first_measurements_price_every_size():
    costs = StepCosts(draft_fraction=0.2)
    assert costs.ratio(4) < 1.2 and math.isclose(costs.draft_cost(), 0.2 * costs.plain_seconds())
    steady(costs, 0.040, {2: 0.060, 8: 0.120})
    costs.observe_draft(0.010)
    assert math.isclose(costs.ratio(2), 1.5) and math.isclose(costs.ratio(8), 3.0)
    assert math.isclose(costs.ratio(5), 2.25) and math.isclose(costs.draft_cost(), 0.010)


def test_the_plain_step_is_timed_again_when_it_has_not_been_lately():
    costs = StepCosts(PROFILE, max_age=64)
    assert not costs.plain_due  # a new engine drafts at once, on its calibration
    steady(costs, 0.050, {4: 0.060}, steps=1)
    for _ in range(40):  # verifications only
        costs.observe_verify(4, 0.060)
        costs.tick()
    assert costs.plain_due
    costs.observe_plain(0.050)
    assert not costs.plain_due


def test_the_calibration_times_bare_forwards(lm):
    profile = measure_calibration(lm.model, context=16, rounds=1)
    assert profile.plain > 0 and set(profile.ratios) == {2, 4, 8, 16}
    assert all(r > 0.5 for r in profile.ratios.values()) and profile.ratio(16) >= profile.ratio(2) * 0.9
