"""experiments.exit_policies: the replay of an exit rule on fixed scores and labels, and a bad limit is one line."""

import json
import subprocess
import sys

import numpy as np
import pytest

from experiments.exit_policies import TARGETS, frontier, patience_odds, replay, with_patience

SAVED_AT = np.array([0.8, 0.4])  # gates at 6 and 18 of 30 layers


def test_replay_exits_at_the_first_gate_reaching_its_threshold():
    scores = np.array([[0.9, 0.9], [0.5, 0.95], [0.1, 0.2], [0.7, 0.99]])
    labels = np.array([[True, True], [False, True], [False, False], [False, False]])
    # token 0 leaves at gate 0 (right), 1 at gate 1 (right), 2 runs every layer, 3 leaves at gate 1 (wrong)
    assert replay(scores, labels, [0.8, 0.9], SAVED_AT) == ((0.8 + 0.4 + 0.0 + 0.4) / 4, 3 / 4)
    # an unchecked gate (threshold inf) never exits: token 3 now runs every layer and stays right
    saved, agree = replay(scores, labels, [0.8, np.inf], SAVED_AT)
    assert (saved, agree) == (0.8 / 4, 1.0)


def test_frontier_keeps_the_most_saved_at_each_agreement_level():
    scores = np.array([[0.9, 0.0], [0.6, 0.0], [0.3, 0.0], [0.1, 0.0]])
    labels = np.array([[True, False], [True, False], [False, False], [False, False]])
    best = frontier(scores, labels, SAVED_AT, lambda t: [t, np.inf])
    # right exits only (tau in (0.3, 0.6]) save 2 x 0.8 of 4 tokens at 100%; one wrong exit more costs 25 points
    assert best == [0.4] * len(TARGETS)


def test_patience_exits_past_the_first_gate_only_where_the_previous_gate_agrees():
    scores = np.array([[0.5, 0.95], [0.5, 0.95], [0.9, 0.1]])
    tokens = np.array([[7, 7], [7, 8], [3, 4]])
    patient = with_patience(scores, tokens)
    # token 1's second exit (8) differs from its first (7): it may not leave there; the first gate is never held back
    assert replay(patient, np.ones((3, 2), bool), [0.8, 0.9], SAVED_AT) == ((0.4 + 0.0 + 0.8) / 3, 1.0)
    np.testing.assert_array_equal(patient[:, 0], scores[:, 0])
    labels = np.array([[True, True], [False, False], [True, True], [False, True]])
    tokens = np.array([[5, 5], [5, 5], [1, 2], [3, 4]])  # two agree (one right), two differ (both right)
    assert patience_odds(labels, tokens) == [(0.5, 1.0)]


@pytest.mark.slow
def test_zero_questions_per_category_is_one_clear_line(tmp_path):
    questions = tmp_path / "question.jsonl"  # its own file: a fresh clone has no ../shared/specbench
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["Hi."]}) + "\n")
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.exit_policies",
            "--questions",
            str(questions),
            "--per-category",
            "0",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "at least 1 question per category" in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "exit_policies.md").exists()
