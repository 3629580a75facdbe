"""bench.gate_agreement: the comparison table's columns, held-out rows with and without their loss mask, and a
missing --rows file is one line, not a traceback."""

import subprocess
import sys

import numpy as np

from bench.gate_agreement import held_out_results, table
from m2r2_mlx.adapters import new_m2r2
from m2r2_mlx.evaluate import gate_agreement

from .tiny import tiny_model


def test_table_adds_the_baseline_column_only_when_measured():
    r = {"gates": [6, 12], "naive": [0.05, 0.08], "m2r2": [0.2, 0.25], "tokens": 100}
    plain = table({"set": r})
    assert "baseline" not in plain and "| L6 | 5.0% | 20.0% |" in plain
    both = table({"set": {**r, "baseline": [0.15, 0.2]}})
    assert "| gate | naive early exit | M2R2, baseline adapters | M2R2 fast stream |" in both
    assert "|---|---|---|---|" in both and "| L12 | 8.0% | 20.0% | 25.0% |" in both


def test_missing_rows_file_is_one_clear_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.gate_agreement", "--rows", str(tmp_path / "nope.npy"),
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
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
    assert list(results) == [f"held-out rows of {paths[0]} (2 rows)", f"held-out rows of {paths[1]} (2 rows)",
                             f"held-out rows of {paths[1]}, answer and text positions only"]
    answers = results[f"held-out rows of {paths[1]}, answer and text positions only"]
    assert answers["tokens"] == mask[:2].sum() and "baseline" in answers
    direct = gate_agreement(m, np.load(paths[1])[:2], mask=mask[:2])["scored"]
    assert answers["m2r2"] == direct["m2r2"] and answers["naive"] == direct["naive"]
