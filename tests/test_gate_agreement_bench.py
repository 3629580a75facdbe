"""experiments.gate_agreement: the comparison table's columns, held-out rows with and without their loss mask, and a
missing --rows file is one line, not a traceback."""

import subprocess
import sys

from m2r2_mlx.core.adapters import new_m2r2
from m2r2_mlx.training.evaluate import gate_agreement

import numpy as np
import pytest

from experiments.gate_agreement import held_out_results, table

from .tiny import tiny_model


def test_table_adds_the_baseline_column_only_when_measured():
    r = {"gates": [6, 12], "layerskip": [0.05, 0.08], "fast": [0.2, 0.25], "tokens": 100}
    plain = table({"set": r})
    assert "baseline" not in plain and "| L6 | 5.0% | 20.0% |" in plain
    both = table({"set": {**r, "baseline": [0.15, 0.2]}})
    assert "| gate | layerskip (the slow state's own exit) | M2R2, baseline adapters | M2R2 fast stream |" in both
    assert "|---|---|---|---|" in both and "| L12 | 8.0% | 20.0% | 25.0% |" in both


@pytest.mark.slow
def test_missing_rows_file_is_one_clear_line(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.gate_agreement",
            "--rows",
            str(tmp_path / "nope.npy"),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "nope.npy not found" in r.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "gate_agreement.md").exists()


def test_held_out_rows_of_several_files_each_keep_their_answer_positions(tmp_path):
    base = tiny_model("llama", seed=31, vocab_size=64, num_hidden_layers=6)
    m, other = new_m2r2(base, gates=[2, 4]), new_m2r2(base, gates=[2, 4], rank=8)
    rng = np.random.default_rng(0)
    paths = []
    for name in ("a", "b"):
        rows = rng.integers(0, 64, size=(3, 16))
        np.save(tmp_path / f"{name}.npy", rows)
        paths.append(tmp_path / f"{name}.npy")
    mask = rng.random((3, 16)) < 0.5
    np.save(tmp_path / "b.mask.npy", mask)  # only b has a loss mask
    results = held_out_results(m, other, paths, eval_rows=2)
    assert list(results) == [
        f"held-out rows of {paths[0]} (2 rows)",
        f"held-out rows of {paths[1]} (2 rows)",
        f"held-out rows of {paths[1]}, answer and text positions only",
    ]
    answers = results[f"held-out rows of {paths[1]}, answer and text positions only"]
    assert answers["tokens"] == mask[:2].sum() and "baseline" in answers
    direct = gate_agreement(m, np.load(paths[1])[:2], mask=mask[:2])["scored"]
    assert answers["fast"] == direct["fast"] and answers["layerskip"] == direct["layerskip"]


def test_naive_exit_after_every_layer_matches_the_gates_naive_exits(tmp_path):
    from m2r2_mlx.training.evaluate import agreement, naive_agreement_by_layer, row_batches

    base = tiny_model("llama", seed=31, vocab_size=64, num_hidden_layers=6)
    m = new_m2r2(base, gates=[2, 4])
    rows = np.random.default_rng(1).integers(0, 64, size=(5, 16))
    curve = naive_agreement_by_layer(m.parts, row_batches(rows, batch_size=2))
    assert len(curve) == 6
    at_gates = agreement(m, row_batches(rows, batch_size=2))["layerskip"]
    assert [curve[1], curve[3]] == at_gates  # after layers 2 and 4: the gates' naive exits
    assert len(set(curve[:-1])) > 1  # the exits differ from layer to layer


def test_every_layer_writes_a_table_row_per_layer_and_a_plot(tmp_path):
    from experiments.gate_agreement import every_layer

    base = tiny_model("llama", seed=31, vocab_size=64, num_hidden_layers=6)
    m = new_m2r2(base, gates=[2, 4])
    rows = np.random.default_rng(2).integers(0, 64, size=(2, 12))
    from m2r2_mlx.training.evaluate import row_batches

    results = {"rows": {"gates": [2, 4], "fast": [0.3, 0.6]}}
    md = every_layer(m, {"rows": row_batches(rows)}, results, tmp_path / "naive_by_layer.png")
    assert "| layer | rows |" in md and "| L6 | 100.0% |" in md and md.count("\n| L") == 6
    assert (tmp_path / "naive_by_layer.png").stat().st_size > 10_000
