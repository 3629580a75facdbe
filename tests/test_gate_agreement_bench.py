"""bench.gate_agreement: the comparison table's columns, and a missing --rows file is one line, not a traceback."""

import subprocess
import sys

from bench.gate_agreement import table


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
