"""The speculative engine's step costs (decoding/costs.py): priced in plain steps, so a slowdown of the whole
machine cancels out; no estimate outlives what it was measured in; the calibrated profile round-trips."""

from __future__ import annotations

import math

from m2r2_mlx.decoding.costs import CostProfile, StepCosts
from m2r2_mlx.decoding.policy import Acceptance, Planner
from m2r2_mlx.decoding.tree import DraftTree

import pytest

PROFILE = CostProfile({0: 0.050}, {0: {1: 1.0, 2: 1.05, 4: 1.12, 8: 1.3, 16: 1.7}}, draft=0.2)


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


def test_planner_decisions_do_not_move_with_the_machines_speed():
    tree = DraftTree.root(1)
    tree.add_chain(0, [2, 3, 4], "lookup")
    acceptance = Acceptance({"lookup": 0.3}, strength=1000)
    choices = []
    for scale in (1, 7):
        costs = StepCosts(PROFILE)
        steady(costs, 0.05 * scale, {2: 0.056 * scale, 4: 0.062 * scale})
        choices.append(Planner(costs, acceptance, max_nodes=8).select(tree)[0])
    assert choices[0] == choices[1]


def test_an_outlier_neither_moves_an_estimate_far_nor_for_long():
    costs = StepCosts(PROFILE, max_age=64)
    steady(costs, 0.050, {2: 0.055})
    costs.observe_verify(2, 1.655)  # one verification while the machine was busy
    assert math.isclose(costs.ratio(2), 1.1)  # the median of the latest few
    costs = StepCosts(PROFILE, max_age=64)
    steady(costs, 0.050, {2: 1.655}, steps=5)  # a whole stretch of them
    assert costs.ratio(2) <= 4 * 1.05  # clipped at 4x the calibrated ratio
    for _ in range(65):  # then no verification of that size, only plain steps
        costs.observe_plain(0.050)
        costs.tick()
    assert math.isclose(costs.ratio(2), 1.05)  # aged out: the calibrated curve again


def test_sizes_not_measured_read_the_calibrated_curve_scaled_by_those_that_were():
    costs = StepCosts(PROFILE)
    assert math.isclose(costs.ratio(3), (1.05 + 1.12) / 2)  # between calibrated sizes
    steady(costs, 0.050, {2: 0.050 * 1.05 * 1.5, 8: 0.050 * 1.3 * 1.5})  # whole steps: 1.5x the bare forwards
    assert math.isclose(costs.ratio(4), 1.12 * 1.5)


def test_a_context_the_calibration_never_saw_is_priced_from_its_first_verifications():
    costs = StepCosts(PROFILE)  # calibrated at a short context (bucket 0)
    costs.context = 1500
    costs.observe_plain(0.060)
    for n in (3, 5, 7, 9, 11):  # one verification of each size, each 1.6x what the calibration says
        costs.observe_verify(n, 0.060 * 1.6 * PROFILE.ratio(0, n))
        costs.tick()
    assert math.isclose(costs.ratio(16), 1.6 * 1.7)  # no size was measured twice, and yet


def test_without_a_profile_estimates_come_from_what_was_measured():
    costs = StepCosts(draft_fraction=0.2)
    steady(costs, 0.050, {8: 0.085})
    assert math.isclose(costs.verify_cost(8), 0.085) and math.isclose(costs.verify_cost(1), 0.050)
    assert math.isclose(costs.verify_cost(4), 0.050 * (1 + 3 * 0.7 / 7))  # the line through 1 and 8
    assert math.isclose(costs.draft_cost(), 0.010)  # before a draft is timed: that share of a plain step
    costs.observe_draft(0.02)
    assert math.isclose(costs.draft_cost(), 0.02)


def test_costs_are_kept_per_context_length():
    costs = StepCosts(PROFILE)
    costs.context = 100
    steady(costs, 0.050, {8: 0.065})
    costs.context = 1500
    steady(costs, 0.060, {8: 0.120})
    assert math.isclose(costs.ratio(8), 2.0)
    costs.context = 300
    assert math.isclose(costs.ratio(8), 1.3) and math.isclose(costs.plain_seconds(), 0.050)


def test_profile_round_trips_and_refines():
    costs = StepCosts(PROFILE)
    steady(costs, 0.040, {4: 0.052})
    refined = costs.profile()  # each value halfway (geometrically) toward what this session measured
    assert math.isclose(refined.plain[0], (0.050 * 0.040) ** 0.5)
    assert math.isclose(refined.ratios[0][4], (1.12 * 1.3) ** 0.5)
    assert refined.ratios[0][8] == 1.3  # sizes not measured keep the calibration's
    assert CostProfile.from_json(refined.to_json()) == refined


@pytest.mark.parametrize(
    "doc",
    [
        {"plain": {"0": -1.0}, "ratios": {}},
        {"plain": {"0": 0.05}, "ratios": {"0": {"2": "fast"}}},
        {"plain": [], "ratios": {}},
        {"ratios": {}},
    ],
)
def test_malformed_profiles_are_refused(doc):
    with pytest.raises((ValueError, TypeError, KeyError, AttributeError)):
        CostProfile.from_json(doc)


def test_the_plain_step_is_timed_again_when_it_was_not_lately():
    """Every ratio is taken against the plain step: an engine that drafts step after step must time one again
    now and then, or it would price its steps against a plain step of another time."""
    costs = StepCosts(PROFILE, max_age=64)
    assert not costs.plain_due  # a new engine drafts at once, on its calibration
    for _ in range(40):
        costs.observe_verify(4, 0.06)
        costs.tick()
    assert costs.plain_due
    costs.observe_plain(0.05)
    assert not costs.plain_due
    costs.context = 2000  # a longer context's plain step has not been timed yet
    assert costs.plain_due
    costs.context = 100
    costs.observe_verify(4, 0.02)  # cheaper than a plain step: the machine sped up since it was timed
    assert costs.plain_due and costs.ratio(4) >= 1.0
    costs.observe_plain(0.015)
    costs.observe_verify(4, 1.5)  # 80 plain steps: slowed down, or an outlier
    assert costs.plain_due


def test_a_chain_that_pays_as_a_whole_is_verified():
    """A first proposal that alone would not pay for the step (30% for 0.32 of a plain step), followed by likely
    ones (lookup copying a span, 90% each once the first is right): the chain pays, and the planner keeps it."""
    costs = StepCosts(CostProfile({0: 0.05}, {0: {2: 1.32, 3: 1.38, 4: 1.44}}))
    acceptance = Acceptance({"lookup": 0.5})
    for i in range(1000):
        acceptance.observe("lookup", 1, None, i % 10 < 3)
        for depth in (2, 3):
            acceptance.observe("lookup", depth, None, i % 10 < 9)
    tree = DraftTree.root(1)
    tree.add_chain(0, [2, 3, 4], "lookup")
    assert Planner(costs, acceptance, max_nodes=8).select(tree)[0] == [0, 1, 2, 3]
    single = DraftTree.root(1)
    single.add_chain(0, [2], "lookup")
    assert Planner(costs, acceptance, max_nodes=8).select(single)[0] == [0]  # alone it does not pay
