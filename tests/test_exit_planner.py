"""Early exit checks a gate only while its expected saving pays for the check (decoding/exit_planner.py): the cost
fit recovers what a token's parts cost, the planner turns a gate off where exits are rare or checks dear and on where
they pay, and a gate left off is tried again once its rate drifts back to the prior."""

from __future__ import annotations

from m2r2_mlx.decoding.exit_planner import GatePlanner, StepFit

import numpy as np
import pytest

STOPS, L = [6, 12, 18, 24], 30


def test_the_cost_fit_recovers_each_parts_seconds():
    truth = np.array([0.002, 0.0005, 0.003, 0.001])  # a pass, an extra row, a check, the token's fixed cost
    fit, rng = StepFit([1.0, 1 / 3, 2.0, 0.0]), np.random.default_rng(0)
    for _ in range(400):
        x = np.array([rng.integers(6, 31), rng.integers(0, 40), rng.integers(0, 5), 1.0])
        fit.observe(x, float(x @ truth))
    for name, want in zip(("pass", "row", "check", "token"), truth):
        assert fit.cost(name) == pytest.approx(want, rel=0.1), name  # the prior holds a little


def test_costs_the_tokens_cannot_tell_apart_keep_the_priors_split():
    """Every token checks one gate (a check and a fixed cost always together): the data price the pair, and the
    prior (no fixed cost) says which part is the check's, so the planner does not see checks as free."""
    truth = np.array([0.002, 0.0005, 0.003, 0.001])
    fit = StepFit([1.0, 1 / 3, 2.0, 0.0])
    for i in range(400):
        x = np.array([6 if i % 3 else 30, 6 + (24 if i % 3 == 1 else 0), 1, 1.0])
        fit.observe(x, float(x @ truth))
    assert fit.cost("check") + fit.cost("token") == pytest.approx(0.004, rel=0.1)
    assert fit.cost("check") > 0.003


def feed(planner: GatePlanner, exit_rate: float, costs: np.ndarray, tokens: int = 300, seed: int = 0) -> None:
    """Tokens whose checked gates exit at ``exit_rate``, each timed by ``costs`` (pass, row, check, fixed)."""
    rng = np.random.default_rng(seed)
    for _ in range(tokens):
        checks = planner.checked()
        verdicts, passes, rows = {}, L, 0
        for j, on in enumerate(checks):
            if not on:
                continue
            rows += STOPS[j] - (STOPS[j - 1] if j else 0)
            verdicts[j] = bool(rng.random() < exit_rate)
            if verdicts[j]:
                passes, rows = STOPS[j], rows + (L - STOPS[j])  # the fill comes as rows of a later token
                break
        x = np.array([passes, rows, sum(checks), 1.0])
        planner.observe(verdicts, passes, rows, sum(checks), float(x @ costs))


def test_rare_exits_or_dear_checks_turn_the_gates_off():
    cheap_rows = np.array([0.002, 0.0001, 0.001, 0.0])
    rare = GatePlanner(STOPS, L)
    feed(rare, exit_rate=0.01, costs=cheap_rows)
    assert not any(rare.checked())
    compute_bound = GatePlanner(STOPS, L)  # an extra row costs as much as a pass: an exit saves nothing
    feed(compute_bound, exit_rate=0.6, costs=np.array([0.002, 0.002, 0.001, 0.0]))
    assert not any(compute_bound.checked())


def test_frequent_exits_with_cheap_rows_keep_the_first_gates_on():
    planner = GatePlanner(STOPS, L)
    feed(planner, exit_rate=0.6, costs=np.array([0.002, 0.0001, 0.001, 0.0]))
    assert planner.checked()[0] and planner.saving(0) > 0


def test_a_gate_left_off_is_tried_again():
    planner = GatePlanner(STOPS, L)
    feed(planner, exit_rate=0.0, costs=np.array([0.002, 0.0001, 0.001, 0.0]))
    assert not planner.checked()[0]
    for _ in range(2000):  # unchecked: no verdicts, the rate decays back to its prior
        planner.observe({}, L, 0, 0, 0.002 * L)
    assert planner.checked()[0]
