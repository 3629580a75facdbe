"""ARLA, the exit-decision head: its math, and its place in an adapters folder."""

import json

from m2r2_mlx.core.adapters import load_adapters, new_m2r2, save_adapters
from m2r2_mlx.core.arla import ARLA, exit_stats
from m2r2_mlx.core.config import M2R2Config
from m2r2_mlx.decoding.methods import packaged_adapters

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from .tiny import tiny_model


def _random_arla(dims=32, latent=8, gates=4, seed=0):
    arla = ARLA(dims, latent, gates)
    mx.random.seed(seed)
    arla.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.5, arla.parameters()))
    return arla


def test_logits_all_equals_one_call_per_prefix():
    arla = _random_arla()
    zs = mx.random.normal((3, 5, 4, 8))  # (batch, tokens, gates, latent)
    all_at_once = arla.logits_all(zs)
    assert all_at_once.shape == (3, 5, 4)
    for n in range(1, 5):
        np.testing.assert_allclose(
            np.array(all_at_once[..., n - 1]), np.array(arla(zs[..., :n, :])), atol=1e-5, rtol=1e-5
        )


def test_first_gate_has_zero_velocity():
    """With one gate, the value the head reads is value([z, 0]): no velocity term."""
    arla = _random_arla()
    z = mx.random.normal((2, 1, 8))
    expect = arla.out(mx.concatenate([arla.value(mx.concatenate([z, mx.zeros_like(z)], -1))[:, 0], z[:, 0]], -1))[
        ..., 0
    ]
    assert mx.array_equal(arla(z), expect).item()


def test_latent_adds_the_gate_embedding():
    arla = _random_arla()
    h = mx.random.normal((2, 32))
    np.testing.assert_allclose(
        np.array(arla.latent(h, 2) - arla.latent(h, 0)),
        np.array(mx.broadcast_to(arla.depth[2] - arla.depth[0], (2, 8))),
        atol=1e-5,
    )


def test_arla_weights_travel_with_the_adapters(tmp_path):
    lm = tiny_model("llama")
    m = new_m2r2(lm, gates=[2, 4], rank=4, arla_dim=8, arla=True)
    names = [k for k, _ in tree_flatten(m.parameters())]
    assert {"arla.depth", "arla.proj.weight", "arla.proj.bias", "arla.out.bias"} <= set(names)
    assert m.arla.depth.shape == (2, 8)
    mx.random.seed(2)
    m.update(tree_map(lambda p: mx.random.normal(p.shape), m.parameters()))
    again = load_adapters(lm, save_adapters(m, tmp_path / "ad"))
    assert again.config.arla
    for (n1, p1), (n2, p2) in zip(tree_flatten(m.parameters()), tree_flatten(again.parameters())):
        assert n1 == n2 and mx.array_equal(p1, p2).item()
    # without the flag, no ARLA weights
    assert not any(k.startswith("arla.") for k, _ in tree_flatten(new_m2r2(lm, gates=[2, 4]).parameters()))


def test_configs_from_before_arla_still_load(tmp_path):
    # a config written before the ARLA and LoRA fields existed: the packaged one minus those keys
    raw = json.loads((packaged_adapters("smollm2") / "m2r2_config.json").read_text())
    old = {k: v for k, v in raw.items() if not k.startswith(("arla", "lora"))}
    assert len(old) < len(raw)
    (tmp_path / "m2r2_config.json").write_text(json.dumps(old))
    cfg = M2R2Config.load(tmp_path)
    assert cfg.arla is False and cfg.adapter_form == "parallel_bottleneck"


@pytest.mark.parametrize("latent", [4, 16])
def test_shapes(latent):
    arla = ARLA(24, latent, 3)
    zs = mx.stack([arla.latent(mx.zeros((5, 24)), j) for j in range(3)], axis=-2)
    assert zs.shape == (5, 3, latent)
    assert arla(zs).shape == (5,) and arla.logits_all(zs).shape == (5, 3)


def test_exit_stats_of_a_known_distribution():
    probs = mx.array([[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25]])
    stats = np.array(exit_stats(mx.log(probs)))
    entropy = -(np.array(probs) * np.log(np.array(probs))).sum(-1) / np.log(4)
    np.testing.assert_allclose(stats, [[0.5, 0.25, entropy[0]], [0.25, 0.0, 1.0]], atol=1e-6)


def test_exit_stats_match_the_softmax_definition_on_wide_logits():
    """The one-exp form equals max p, its margin and the normalised entropy of softmax(logits)."""
    x = np.random.default_rng(3).normal(size=(4, 4096)).astype(np.float32) * np.array(
        [[0.1], [2], [8], [30]], np.float32
    )
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.sort(p, -1)
    entropy = -(p * np.log(np.maximum(p, 1e-38))).sum(-1) / np.log(4096)
    want = np.stack([top[:, -1], top[:, -1] - top[:, -2], entropy], -1)
    np.testing.assert_allclose(np.array(exit_stats(mx.array(x))), want, atol=2e-6)


def test_arla_with_exit_stats_reads_them_and_saves_them(tmp_path):
    """A head built to read the exit statistics learns a label they decide, which the residual alone cannot;
    its extra weights travel with the adapters folder."""
    from m2r2_mlx.training.exit_decisions import arla_logits, fit, predict, roc_auc

    rng = np.random.default_rng(0)
    h = rng.normal(size=(2000, 2, 32)).astype(np.float32)  # carries no information about the label
    stats = rng.random((2000, 2, 3)).astype(np.float32)
    y = stats[..., 0] > 0.6
    aucs = {}
    for reads in (True, False):
        mx.random.seed(1)
        arla = ARLA(32, 8, 2, exit_stats=reads)
        fit(arla, arla_logits, [h[:1500], stats[:1500]], y[:1500], steps=300, seed=1)
        p = predict(arla_logits, arla, [h[1500:], stats[1500:]])
        aucs[reads] = roc_auc(p[:, 1], y[1500:, 1])
    assert aucs[True] > 0.95 and aucs[False] < 0.65

    lm = tiny_model("llama")
    m = new_m2r2(lm, gates=[2, 4], rank=4, arla_dim=8, arla=True)
    m.config.arla_exit_stats = True
    m.arla = ARLA(m.config.hidden_size, 8, 2, exit_stats=True)
    again = load_adapters(lm, save_adapters(m, tmp_path / "ad"))
    assert again.arla.exit_stats and "arla.exit_proj.weight" in dict(tree_flatten(again.parameters()))
