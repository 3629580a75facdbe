"""The one estimator both planners learn with (m2r2_mlx/estimates.py): decaying Beta rates under coarse-to-fine
keys, and the probe budget."""

from m2r2_mlx.estimates import ProbeBudget, Rates

import pytest


def test_rates_fall_back_to_coarser_keys_and_decay():
    rates = Rates(prior=0.25, strength=2.0, decay=0.5)
    assert rates.mean(("fine", "coarse")) == pytest.approx(0.25)
    assert rates.mean(("fine", "coarse"), prior=0.75) == pytest.approx(0.75)  # a prior per call
    for _ in range(50):
        rates.observe(("other", "coarse"), True)
    assert rates.mean(("fine", "coarse")) > 0.9  # an unseen fine key reads the coarse one's rate
    rates.tick()
    assert rates.counts["coarse"] == [25.0, 25.0]


def test_an_unused_rate_drifts_back_to_its_prior_so_it_is_tried_again():
    rates = Rates(prior=0.5, decay=0.9)
    for _ in range(50):
        rates.observe(("fast", 1), False)
        rates.tick()
    assert rates.mean(("fast", 1)) < 0.1  # sure it fails
    for _ in range(60):
        rates.tick()
    assert rates.mean(("fast", 1)) > 0.4  # its counts decayed: back near its prior


def test_probe_budget_earns_a_share_and_spends_losses():
    budget = ProbeBudget(share=0.01)
    budget.earn(10.0)
    assert budget.affords(0.1) and not budget.affords(0.11)
    budget.spend(0.08)
    assert not budget.affords(0.05)
    assert not ProbeBudget(share=0.0).affords(0.0)
