"""One TrainConfig and one command line for both trainers: m2r2-train and m2r2-train-torch take the same shared flags
with the same defaults, every value they parse lands in a config (none is dropped on the way to the library), and bad
settings are one line."""

import argparse
import subprocess
import sys
from dataclasses import fields

import m2r2_mlx
from m2r2_mlx.core.config import M2R2Config
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.training.cli import train_parser
from m2r2_mlx.training.config import TrainConfig, from_flags, train_gate_indices
from m2r2_mlx.training.train import MLXTrainOptions
from m2r2_mlx.training.train import build_parser as mlx_parser

import pytest

torch = pytest.importorskip("torch")

from m2r2_torch.train import TorchTrainOptions  # noqa: E402
from m2r2_torch.train import build_parser as torch_parser  # noqa: E402


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest not in ("help", "version")}


def _names(cls) -> set[str]:
    return {f.name for f in fields(cls)}


def test_both_trainers_share_the_flags_and_defaults_of_train_config():
    shared = _flags(train_parser("x", "x"))
    mlx, torch_ = _flags(mlx_parser()), _flags(torch_parser())
    for dest, action in shared.items():
        for own in (mlx, torch_):
            assert own[dest].option_strings == action.option_strings and own[dest].default == action.default, dest
    defaults = TrainConfig(output="out")
    for dest, action in shared.items():
        if dest != "output":
            expected = getattr(defaults, dest)
            assert (tuple(action.default) if isinstance(action.default, list) else action.default) == expected, dest
    assert set(shared) == _names(TrainConfig) - {"stage"}  # the stage's choices are each trainer's own


@pytest.mark.parametrize(
    "parser, options, outside",
    [(mlx_parser, MLXTrainOptions, {"private"}), (torch_parser, TorchTrainOptions, set())],
)
def test_every_parsed_value_lands_in_a_config(parser, options, outside):
    assert set(_flags(parser())) == _names(TrainConfig) | _names(options) | outside
    flags = vars(parser().parse_args(["-o", "o", "--gates", "6,12", "--rank", "8,4", "--text", "a", "b"]))
    config = from_flags(TrainConfig, flags)
    assert (config.gates, config.rank, config.adapter_rank, config.text) == ((6, 12), (8, 4), [8, 4], ("a", "b"))
    assert from_flags(options, flags) == options()  # the defaults: the dataclass's and the parser's agree


def test_the_stages_are_each_trainers_own():
    assert mlx_parser().parse_args(["-o", "o"]).stage == "both"
    assert torch_parser().parse_args(["-o", "o"]).stage == "adapters"
    with pytest.raises(M2R2Error, match="--stage arla is not one of data, adapters"):
        TrainConfig(output="o", stage="arla").check(("data", "adapters"))


def test_recipe_records_the_settings_not_the_run():
    recipe = TrainConfig(output="o", force=True, upload_repo="me/x", train_gates=(6,)).recipe(MLXTrainOptions())
    assert not {"output", "force", "resume", "upload_repo"} & set(recipe)
    assert recipe["train_gates"] == (6,) and recipe["exit_vocab"] == 4096 and recipe["distill_temp"] == 1.0


def test_bad_settings_are_one_line():
    with pytest.raises(M2R2Error, match="--batch-size must be at least 1"):
        TrainConfig(output="o", batch_size=0).check()
    cfg = M2R2Config(gates=[2, 4], num_layers=6, hidden_size=8)
    assert train_gate_indices(cfg, (4,)) == [1] and train_gate_indices(cfg, None) is None
    with pytest.raises(M2R2Error, match=r"--train-gates 3 must name gates of the adapters, which are \[2, 4\]"):
        train_gate_indices(cfg, (3,))
    r = subprocess.run(
        [sys.executable, "-m", "m2r2_torch.train", "-o", "o", "--gates", "6,x"], capture_output=True, text=True
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .endswith("--gates takes comma-separated layer numbers, e.g. 6,12,18 (got '6,x')")
    )


def test_the_pytorch_trainer_tells_its_version():
    r = subprocess.run([sys.executable, "-m", "m2r2_torch.train", "--version"], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip() == f"m2r2-train-torch {m2r2_mlx.__version__}", r.stderr
