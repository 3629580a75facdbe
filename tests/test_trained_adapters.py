"""The committed adapters for the embedded model (m2r2_mlx/trained/smollm2) load and beat naive early exit."""

from pathlib import Path

from m2r2_mlx.core.adapters import load_adapters
from m2r2_mlx.training.evaluate import gate_agreement

import numpy as np
import pytest
from mlx.utils import tree_flatten

ADAPTERS = Path(__file__).resolve().parents[1] / "m2r2_mlx" / "trained" / "smollm2"
TEXT = (
    "The museum opened a new exhibition about the history of flight. Visitors can see early gliders, "
    "a replica of the first powered aircraft, and the engines that carried passengers across the ocean. "
    "A guide explains how wings create lift and why the shape of a propeller matters. Children can sit "
    "in a cockpit and try the controls, while older visitors read letters written by pilots."
)


@pytest.mark.skipif(not ADAPTERS.is_dir(), reason="m2r2_mlx/trained/smollm2 not trained yet")
def test_committed_adapters_load_and_beat_naive_exit(lm):
    m2r2 = load_adapters(lm, ADAPTERS)
    assert m2r2.config.num_layers == 30 and m2r2.config.gates == [6, 12, 18, 24]
    params = sum(v.size for _, v in tree_flatten(m2r2.parameters()))
    assert params < 0.03 * 134_515_008  # adapters < 3% of the base
    rows = np.array([lm.tokenizer.encode(TEXT)])
    r = gate_agreement(m2r2, rows)
    # a held-out paragraph: the fast stream agrees with the full model more often than the naive exit, at every gate
    assert all(f > n for f, n in zip(r["fast"], r["layerskip"])), r
