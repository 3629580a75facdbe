"""Splicing adapters (m2r2_tools.splice_adapters): the first interval and the context feature from one folder,
every other tensor and file from the other; folders of different shapes are refused in one line."""

import subprocess
import sys

from m2r2_mlx.core.adapters import add_context_feature, load_adapters, new_m2r2, save_adapters
from m2r2_mlx.errors import M2R2Error

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from m2r2_tools.splice_adapters import splice

from .tiny import randomize, tiny_model


def _folder(lm, path, seed, rank=8):
    m = add_context_feature(new_m2r2(lm, gates=[2, 4], rank=rank, arla=True))
    randomize(m, seed=seed)
    return save_adapters(m, path)


def test_the_first_interval_comes_from_one_folder_and_the_rest_from_the_other(tmp_path):
    lm = tiny_model("llama")
    first, rest = _folder(lm, tmp_path / "first", seed=1), _folder(lm, tmp_path / "rest", seed=2)
    taken = splice(first, rest, tmp_path / "out")
    got = dict(tree_flatten(load_adapters(lm, tmp_path / "out").parameters()))
    a = dict(tree_flatten(load_adapters(lm, first).parameters()))
    b = dict(tree_flatten(load_adapters(lm, rest).parameters()))
    assert set(taken) == {k for k in got if k.startswith(("adapters.0.", "adapters.1.", "context."))}
    for k, v in got.items():
        assert mx.array_equal(v, a[k] if k in taken else b[k]).item(), k
    assert any(k.startswith("arla.") for k in got) and not any(k.startswith("arla.") for k in taken)


def test_folders_of_different_shapes_are_refused_in_one_line(tmp_path):
    lm = tiny_model("llama")
    first, rest = _folder(lm, tmp_path / "first", seed=1), _folder(lm, tmp_path / "rest", seed=2, rank=4)
    with pytest.raises(M2R2Error, match="differ in gates, ranks"):
        splice(first, rest, tmp_path / "out")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "m2r2_tools.splice_adapters",
            "--first",
            str(first),
            "--rest",
            str(first),
            "-o",
            str(first),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "already exists" in proc.stderr and "Traceback" not in proc.stderr
