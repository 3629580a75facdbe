"""experiments.draft_calibration: acceptance by draft probability beside the measured cost of drafting."""

import json
import subprocess
import sys

import pytest

from experiments.draft_calibration import table


def test_table_marks_what_is_worth_verifying():
    pairs = [(0.05, False)] * 9 + [(0.05, True)] + [(0.8, True)] * 3 + [(0.8, False)]
    costs = {"plain step ms": 100.0, "draft step": 0.2, "verify 2 tokens": 1.25}
    lines = table(pairs, costs)
    assert "| 0.0-0.1 | 10 | 10% | no |" in lines  # 10% < 0.25, the cost of one more verified position
    assert "| 0.7-1.0 | 4 | 75% | yes |" in lines
    assert "| all | 14 | 29% | |" in lines
    assert "0.45 here; measured 29%, so drafting does not pay" in lines[-1]


@pytest.mark.slow
def test_calibration_runs_on_the_packaged_adapters(tmp_path):
    q = tmp_path / "question.jsonl"
    q.write_text(json.dumps({"question_id": 1, "category": "qa", "turns": ["Name three colours."]}) + "\n")
    out = tmp_path / "calibration.md"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.draft_calibration",
            "--questions",
            str(q),
            "--categories",
            "qa",
            "--max-tokens",
            "12",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    text = out.read_text()
    assert "fast@L6" in text and "| all | " in text and "verify 2 tokens" in text
    assert out.with_suffix(".png").stat().st_size > 10_000


def test_policy_speedups_and_ceilings_follow_the_cost_model():
    from experiments.draft_calibration import ceilings, policy_speedups

    # 10 steps: 2 sure drafts (one accepted), 8 unsure (one accepted); a draft step 0.2, verifying 2 tokens 1.25
    pairs = [(0.9, True), (0.9, False)] + [(0.1, True)] + [(0.1, False)] * 7
    costs = {"draft step": 0.2, "verify 2 tokens": 1.25, "verify 3 tokens": 1.4}
    rows = {t: r for t, *r in policy_speedups(pairs, costs, thresholds=(0.0, 0.5))}
    assert rows[0.0][:2] == [1.0, 0.2]
    assert abs(rows[0.0][2] - 12 / 14.5) < 1e-9 and abs(rows[0.0][3] - 12 / 14.5) < 1e-9  # no step left to skip
    share, rate, every, oracle = rows[0.5]
    assert (share, rate) == (0.2, 0.5)
    assert abs(every - 11 / (2 + 2 * 1.25 + 8)) < 1e-9  # every step pays its draft; 8 verify one token only
    assert abs(oracle - 11 / (2 * 1.45 + 8)) < 1e-9 and oracle > every
    assert ceilings(costs) == [(1, pytest.approx(2 / 1.45)), (2, pytest.approx(3 / 1.8))]


def test_acceptance_needed_inverts_the_cost_model():
    from experiments.draft_calibration import acceptance_needed

    costs = {"draft step": 0.2, "verify 2 tokens": 1.1, "verify 4 tokens": 1.3}
    (k1, t1, x1), (k3, t3, x3) = acceptance_needed(costs)
    assert (k1, k3) == (1, 3)
    assert t1 != t1 and x1 != x1  # one draft yields at most 2 tokens, and 2 / 1.3 < 2.0x
    assert 1 + t3 + t3**2 + t3**3 == pytest.approx(3.0, abs=1e-6)
    assert (1 + x3 + x3**2 + x3**3) / (3 * 0.2 + 1.3) == pytest.approx(2.0, abs=1e-6)


def test_signal_table_splits_steps_by_what_is_known_before_drafting():
    from experiments.draft_calibration import signal_table

    signals = [(0.1, None, False), (0.1, False, True), (0.99, True, True), (0.99, True, False), (0.5, False, False)]
    lines = signal_table(signals)
    assert "| full model's probability of the last token 0.00-0.20 | 2 | 50% |" in lines
    assert "| full model's probability of the last token 0.95-1.00 | 2 | 50% |" in lines
    assert "| previous step's draft accepted | 2 | 50% |" in lines
    assert "| previous step's draft rejected | 2 | 50% |" in lines  # the first step has no previous one


@pytest.mark.slow
def test_signals_read_the_full_models_probability_of_the_token_each_draft_follows(lm):
    from m2r2_mlx.decoding.config import DecodeConfig, GenerationConfig
    from m2r2_mlx.decoding.generate import generate
    from m2r2_mlx.decoding.methods import fast_drafter

    import mlx.core as mx

    from experiments.draft_calibration import acceptance_by_confidence

    question = "Name three colours."
    drafter = fast_drafter(lm, DecodeConfig(), None, threshold=0.0)
    pairs, signals = acceptance_by_confidence(lm, drafter, [{"turns": [question]}], max_tokens=16)
    assert len(pairs) == len(signals) > 3 and [a for _, a in pairs] == [a for *_, a in signals]
    assert signals[0][1] is None and [p for _, p, _ in signals[1:]] == [a for *_, a in signals[:-1]]
    prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    answer = [
        e.token for e in generate(lm.model, lm.tokenizer, prompt, GenerationConfig(16))
    ]  # what speculation emits too
    probs = mx.softmax(lm.model(mx.array([prompt + answer]))[0].astype(mx.float32), axis=-1).max(-1).tolist()
    index = 0  # the answer token each step's draft follows: one per step, two after an accepted draft
    for p, _, accepted in signals:
        assert p == pytest.approx(probs[len(prompt) - 1 + index], rel=1e-3, abs=1e-4)
        index += 1 + accepted
