"""M2R2 adapters trained on an MoE's routing (m2r2_mlx/moe/router_target.py): a few steps on a tiny random OLMoE
lower the loss and raise the recall of the experts the exits predict; the folder round-trips through load_adapters;
bad input is one line each (python -m m2r2_mlx.moe adapters)."""

import json

from m2r2_mlx.core.adapters import load_adapters, new_m2r2, save_adapters
from m2r2_mlx.core.integrity import record_hashes
from m2r2_mlx.errors import M2R2Error
from m2r2_mlx.moe.router_adapters import RouterAdaptersSpec, train_router_adapters
from m2r2_mlx.moe.router_target import RouterTarget, RouterTargetConfig, exit_targets

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from tests.tiny import tiny_model

from .inprocess import run_main

ROWS = np.random.default_rng(0).integers(0, 101, (12, 16))


def test_a_few_steps_lower_the_loss_and_raise_the_recall():
    lm = tiny_model("olmoe")
    target = RouterTarget(new_m2r2(lm, gates=[2, 4], rank=8), RouterTargetConfig(steps=12, lr=1e-2, batch_size=4))
    assert target.targets == {0: [2, 3, 4, 5], 1: [4, 5]}  # the next interval and the one after, capped at the top
    before, recall_before = target.eval_loss(ROWS[:4]), target.evaluate(ROWS[:4])
    log = target.train(ROWS, progress=False)
    assert len(log) == 12 and target.eval_loss(ROWS[:4]) < before
    after = target.evaluate(ROWS[:4])
    assert after["recall_next_interval"] > recall_before["recall_next_interval"]
    assert set(after["recall_by_distance"]) == {1, 2, 3, 4} and 0 < after["pregating_recall_next_layer"] <= 1


def test_exit_targets_for_the_benchmark_models_gates():
    class Parts:
        num_layers = 30

    class Config:
        gates = [6, 12, 18, 24]

    class M:
        parts, config = Parts(), Config()

    assert exit_targets(M(), list(range(30))) == {
        0: list(range(6, 18)),
        1: list(range(12, 24)),
        2: list(range(18, 30)),
        3: list(range(24, 30)),
    }


def test_the_folder_round_trips_through_load_adapters(tmp_path):
    lm = tiny_model("olmoe")
    ids = tmp_path / "ids.npy"
    np.save(ids, ROWS.reshape(-1))
    spec = RouterAdaptersSpec(
        out=tmp_path / "adapters",
        ids=ids,
        gates=(2, 4),
        rank=8,
        seq_len=16,
        eval_rows=2,
        train=RouterTargetConfig(steps=3, batch_size=2),
    )
    record = train_router_adapters(lm, spec, progress=False)
    assert record["train_rows"] == 10 and record["heldout_rows"] == 2 and len(record["loss"]) == 3
    loaded = load_adapters(tiny_model("olmoe"), tmp_path / "adapters")
    assert loaded.config.extra["router_target"]["after"] == json.loads(json.dumps(record["after"]))
    assert loaded.config.gates == [2, 4]
    trained = RouterTarget(loaded)
    assert trained.evaluate(ROWS[-2:])["recall_next_interval"] == pytest.approx(record["after"]["recall_next_interval"])
    with pytest.raises(M2R2Error, match="already exists"):
        train_router_adapters(lm, spec, progress=False)


@pytest.mark.slow  # (subprocesses)
def test_bad_input_is_one_line(tmp_path):
    with pytest.raises(M2R2Error, match="needs a mixture-of-experts base"):
        RouterTarget(new_m2r2(tiny_model("llama"), gates=[2, 4], rank=4))
    with pytest.raises(M2R2Error, match="--lr and --temperature positive"):
        RouterTargetConfig(temperature=0).check()
    ids = tmp_path / "ids.npy"
    np.save(ids, ROWS.reshape(-1))
    base = ["-o", str(tmp_path / "out"), "--model", "no-such-model"]
    for args, says in [
        ([], "--text files or as --ids"),
        (["--ids", str(tmp_path / "none.npy")], "none.npy not found"),
        (["--ids", str(ids), "--seq-len", "2"], "--seq-len must be at least 8"),
        (["--ids", str(ids), "--gates", "2,x"], "--gates takes comma-separated layer numbers"),
    ]:
        r = run_main("m2r2_mlx.moe.__main__", "adapters", *base, *args)
        assert r.returncode != 0 and says in r.stderr and "Traceback" not in r.stderr, r.stderr[-500:]
        assert len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_training_leaves_the_base_untouched():
    lm = tiny_model("olmoe")
    before = {k: np.array(v) for k, v in tree_flatten(lm.model.parameters())}
    RouterTarget(new_m2r2(lm, gates=[2, 4], rank=8), RouterTargetConfig(steps=2)).train(ROWS, progress=False)
    after = dict(tree_flatten(lm.model.parameters()))
    assert all(np.array_equal(before[k], np.array(after[k])) for k in before)
    assert all(type(b.gate).__name__ == "Linear" for b in (layer.mlp for layer in lm.model.model.layers))
    mx.eval(after)


def test_a_warm_start_keeps_the_init_folders_other_files(tmp_path):
    lm = tiny_model("olmoe")
    save_adapters(new_m2r2(lm, gates=[2, 4], rank=8), tmp_path / "init")
    (tmp_path / "init" / "draft_vocab.json").write_text("[1, 2, 3]")  # an exit vocabulary travels with its adapters
    record_hashes(tmp_path / "init")  # (a file added to a folder is recorded, as the integrity check asks)
    ids = tmp_path / "ids.npy"
    np.save(ids, ROWS.reshape(-1))
    spec = RouterAdaptersSpec(
        out=tmp_path / "init", ids=ids, init=tmp_path / "init", seq_len=16, eval_rows=2, force=True,
        train=RouterTargetConfig(steps=1, batch_size=2),
    )  # fmt: skip
    train_router_adapters(lm, spec, progress=False)
    assert (tmp_path / "init" / "draft_vocab.json").read_text() == "[1, 2, 3]"
    assert "router_target" in load_adapters(lm, tmp_path / "init").config.extra
