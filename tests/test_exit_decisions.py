"""Exit decisions: ROC AUC is right, ARLA trains on exits and drives early exit, the trainer's ARLA stage."""

import json
import shutil

from m2r2_mlx.core.adapters import load_adapters, new_m2r2, save_adapters
from m2r2_mlx.core.arla import ARLA, ARLARule
from m2r2_mlx.core.config import AdapterMetrics
from m2r2_mlx.decoding.config import GenerationConfig
from m2r2_mlx.decoding.early_exit import ExitPolicy
from m2r2_mlx.decoding.generate import generate
from m2r2_mlx.training.exit_decisions import collect_features, roc_auc, train_exit_decisions

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from .inprocess import run_main
from .tiny import EosAs, early_exit_generate, tiny_model


def test_roc_auc_equals_pairwise_count():
    rng = np.random.default_rng(0)
    y = rng.random(500) < 0.3
    s = np.round(y + rng.normal(size=500), 1)  # ties included
    pos, neg = s[y], s[~y]
    pairwise = (pos[:, None] > neg[None]).mean() + 0.5 * (pos[:, None] == neg[None]).mean()
    assert roc_auc(s, y) == pytest.approx(pairwise)
    assert roc_auc(y.astype(float), y) == 1.0 and np.isnan(roc_auc(s, np.zeros(500, bool)))


@pytest.fixture(scope="module")
def tiny(lm):
    base = tiny_model("llama", seed=31, vocab_size=64, num_hidden_layers=6)
    m = new_m2r2(base, gates=[2, 4])
    mx.random.seed(32)
    m.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.05, m.parameters()))
    m.config.arla, m.config.arla_dim = True, 16
    m.arla = ARLA(m.config.hidden_size, 16, 2)
    mx.eval(m.parameters())
    return base, m


def test_arla_learns_exit_labels_and_reports_every_baseline(tiny):
    _, m = tiny
    rows = np.random.default_rng(1).integers(0, 64, size=(24, 32))
    feats = collect_features(m, rows[:16])
    held = collect_features(m, rows[16:])
    assert feats["h"].shape == (16 * 32, 2, 64) and set(np.unique(feats["label"])) <= {0, 1}
    result = train_exit_decisions(m, feats, held, steps=60)
    assert set(result["auc"]) == {"confidence", "linear probe", "arla"}
    assert all(0 <= a <= 1 for aucs in result["auc"].values() for a in aucs if not np.isnan(a))
    assert result["arla_loss"][1] < result["arla_loss"][0]  # it learned something about its labels


def test_features_over_an_exit_vocabulary(tiny):
    """Exits scored over a subset: the label asks whether the subset's argmax is the full model's token."""
    _, m = tiny
    rows = np.random.default_rng(2).integers(0, 64, size=(4, 16))
    ids = list(range(0, 64, 2))
    feats = collect_features(m, rows, exit_ids=ids)
    states, final, kv = m.slow_pass(mx.array(rows))
    target = np.array(m.parts.head(final).argmax(-1)).ravel()
    for j, h in enumerate(m.fast_states(states, kv)):
        sub = np.array(m.parts.head(h)[..., mx.array(ids)]).reshape(-1, len(ids))
        np.testing.assert_array_equal(feats["token"][:, j], np.array(ids)[sub.argmax(-1)])
        np.testing.assert_array_equal(feats["label"][:, j], feats["token"][:, j] == target)
    assert not feats["label"][np.isin(target, ids, invert=True)].any()  # a token outside the subset never matches


def test_features_keep_the_masked_tokens_only(tiny):
    """A loss mask (answers, not prompts) keeps exactly those tokens' features, in order, across batches."""
    _, m = tiny
    rows = np.random.default_rng(3).integers(0, 64, size=(6, 16))
    mask = np.random.default_rng(4).random(rows.shape) < 0.4
    every, kept = collect_features(m, rows, batch_size=4), collect_features(m, rows, batch_size=4, mask=mask)
    for key in ("h", "stats", "label", "token"):
        np.testing.assert_array_equal(kept[key], every[key][mask.ravel()])


def test_arla_rule_drives_early_exit_and_survives_save_load(lm, tiny, tmp_path):
    base, m = tiny
    save_adapters(m, tmp_path / "a")
    loaded = load_adapters(base, tmp_path / "a")
    h = mx.random.normal((1, 64))
    assert ARLARule(loaded.arla)(None, h, 0, []) == pytest.approx(ARLARule(m.arla)(None, h, 0, []), abs=1e-6)
    tok = EosAs(lm.tokenizer, 10**6)
    plain = [e.token for e in generate(base.model, tok, [3, 4, 5], GenerationConfig(10))]
    never = list(
        early_exit_generate(
            loaded, tok, [3, 4, 5], GenerationConfig(10), policy=ExitPolicy(tau=1.01, rule=ARLARule(loaded.arla))
        )
    )
    assert [e.token for e in never] == plain
    always = list(
        early_exit_generate(
            loaded, tok, [3, 4, 5], GenerationConfig(10), policy=ExitPolicy(tau=0.0, rule=ARLARule(loaded.arla))
        )
    )
    assert {e.exit_layer for e in always[1:]} == {2}


def train(*args):
    """m2r2-train's main() in this process."""
    return run_main("m2r2_mlx.training.train", *args)


@pytest.mark.slow
def test_negative_exit_vocab_is_one_clear_line(tmp_path):
    r = train("--exit-vocab", "-1", "-o", str(tmp_path / "o"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--exit-vocab must be 0" in r.stderr.strip().splitlines()[-1] and not (tmp_path / "o").exists()


def test_adapters_whose_exit_vocabulary_file_is_missing_are_refused(tiny, tmp_path):
    from m2r2_mlx.errors import M2R2Error

    base, m = tiny
    m.config.exit_vocab = 8
    try:
        save_adapters(m, tmp_path / "a")  # no draft_vocab.json beside it
    finally:
        m.config.exit_vocab = 0
    with pytest.raises(M2R2Error, match="no draft_vocab.json.*set exit_vocab to 0"):
        load_adapters(base, tmp_path / "a")


@pytest.mark.slow
def test_trainer_arla_stage_on_existing_adapters(tmp_path):
    """m2r2-train --stage arla --init: ARLA weights and AUCs land beside the adapters, adapters untouched."""
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 37} and thing{i % 11}." for i in range(3000)))
    common = [
        "--text",
        str(text),
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--eval-rows",
        "2",
        "--gates",
        "10,20",
    ]
    first = train(*common, "--steps", "2", "--stage", "adapters", "--rank", "4", "-o", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-2000:]
    r = train(
        *common,
        "--stage",
        "arla",
        "--init",
        str(tmp_path / "a"),
        "--arla-rows",
        "4",
        "--arla-steps",
        "20",
        "-o",
        str(tmp_path / "b"),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((tmp_path / "b" / "m2r2_config.json").read_text())
    assert (
        cfg["arla"]
        and cfg["arla_exit_stats"]
        and set(cfg["metrics"]["exit_auc"]["auc"]) == {"confidence", "linear probe", "arla"}
    )
    assert "exit ROC AUC" in r.stderr and (tmp_path / "b" / "draft_vocab.json").is_file()
    vocab = json.loads((tmp_path / "b" / "draft_vocab.json").read_text())["tokens"]
    assert cfg["exit_vocab"] == min(4096, len(vocab))  # ARLA learned on exits over the most frequent tokens
    a = mx.load(str(tmp_path / "a" / "adapters.safetensors"))
    b = mx.load(str(tmp_path / "b" / "adapters.safetensors"))
    assert any(k.startswith("arla.") for k in b) and all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.mark.slow
def test_trainer_data_stage_then_widened_first_interval(tmp_path):
    """--stage data writes the rows only; a later run trains on them (--data), widening one interval
    of earlier adapters (--rank) and training it alone (--train-gates): the other interval is untouched."""
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 37} and thing{i % 11}." for i in range(3000)))
    common = [
        "--seq-len",
        "64",
        "--batch-size",
        "2",
        "--eval-rows",
        "2",
        "--gates",
        "10,20",
        "--stage",
        "adapters",
        "--steps",
        "2",
    ]
    r = train("--text", str(text), "--seq-len", "64", "--stage", "data", "-o", str(tmp_path / "d"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert {f.name for f in (tmp_path / "d").iterdir()} == {"data.npy", "data.mask.npy"}
    rows = str(tmp_path / "d" / "data.npy")
    mask = np.load(tmp_path / "d" / "data.mask.npy")
    assert (
        mask.shape == np.load(rows).shape and mask.all()
    )  # plain text: every position (its last one, a seam, is in the dropped tail)
    # rows packed before masks were kept get theirs added, the rows themselves untouched
    (tmp_path / "d" / "data.mask.npy").unlink()
    before = (tmp_path / "d" / "data.npy").read_bytes()
    r = train("--text", str(text), "--seq-len", "64", "--stage", "data", "--resume", "-o", str(tmp_path / "d"))
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "d" / "data.npy").read_bytes() == before
    assert np.array_equal(np.load(tmp_path / "d" / "data.mask.npy"), mask)
    first = train(*common, "--data", rows, "--rank", "4", "--loss-on", "answers", "-o", str(tmp_path / "a"))
    assert first.returncode == 0, first.stderr[-2000:]
    assert "answers and text only" in first.stdout
    # rows without their mask: --loss-on answers says what is missing and how to get it, in one line
    shutil.copy(rows, tmp_path / "bare.npy")
    r = train(*common, "--data", str(tmp_path / "bare.npy"), "--loss-on", "answers", "-o", str(tmp_path / "x"))
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "bare.mask.npy" in r.stderr.strip().splitlines()[-1] and "--stage data" in r.stderr
    r = train(
        *common,
        "--data",
        rows,
        "--init",
        str(tmp_path / "a"),
        "--rank",
        "8,4",
        "--train-gates",
        "10",
        "-o",
        str(tmp_path / "w"),
    )
    assert r.returncode == 0, r.stderr[-2000:]
    cfg = json.loads((tmp_path / "w" / "m2r2_config.json").read_text())
    assert cfg["adapter_rank"] == [8, 4] and cfg["extra"]["recipe"]["train_gates"] == [10]
    a = mx.load(str(tmp_path / "a" / "adapters.safetensors"))
    w = mx.load(str(tmp_path / "w" / "adapters.safetensors"))
    assert w["adapters.0.down.weight"].shape == (8, 576) and w["adapters.10.down.weight"].shape == (4, 576)
    assert all(mx.array_equal(a[k], w[k]).item() for k in a if int(k.split(".")[1]) >= 10)
    assert not mx.array_equal(a["adapters.0.up.weight"], w["adapters.0.up.weight"][:, :4]).item()


def test_exit_rule_follows_the_measured_auc(tiny):
    """Early exit uses ARLA only where it separated right from wrong exits better than confidence on average."""
    from m2r2_mlx.decoding.early_exit import confidence
    from m2r2_mlx.decoding.methods import exit_rule

    _, m = tiny
    metrics = m.config.metrics
    try:
        m.config.metrics = AdapterMetrics(exit_auc={"auc": {"confidence": [0.80, 0.84], "arla": [0.79, 0.86]}})
        assert isinstance(exit_rule(m), ARLARule)  # mean 0.825 > 0.82
        m.config.metrics = AdapterMetrics(exit_auc={"auc": {"confidence": [0.80, 0.84], "arla": [0.79, 0.84]}})
        assert exit_rule(m) is confidence
    finally:
        m.config.metrics = metrics
