"""The "lora" adapter form: deltas on the base's projections, in the fast stream only."""

from m2r2_mlx.core.adapters import load_adapters, new_m2r2, save_adapters
from m2r2_mlx.errors import M2R2Error

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from .tiny import random_ids, randomize, tiny_model

TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],  # phi3 fuses its projections
}


def _ids(T=7, B=2, seed=3):
    return random_ids(T, B, seed)


def _randomize(m, seed=1):
    randomize(m, 0.1, seed)


@pytest.mark.parametrize("arch", list(TARGETS))
def test_fresh_lora_fast_stream_is_the_base_exactly(arch):
    lm = tiny_model(arch)
    m = new_m2r2(lm, gates=[2, 4], rank=4, lora_targets=TARGETS[arch], lora_scale=2.0)
    assert all(k.startswith("lora.") for k, _ in tree_flatten(m.parameters()))
    assert len(m.lora) == 4  # layers 0..3, none past the last gate
    ids = _ids()
    cache = make_prompt_cache(lm.model)
    lm.model(ids[:, :-1], cache=cache)
    h = m.parts.embed(ids[:, -1:])
    fast = m.fast_exit_state(h, 0, cache)
    slow = m.parts.run_layers(h, 0, 2, None, cache)
    assert mx.array_equal(fast, slow).item()


@pytest.mark.parametrize("arch", list(TARGETS))
def test_nonzero_lora_changes_the_fast_stream_only(arch):
    lm = tiny_model(arch)
    ids = _ids()
    base_logits = lm.model(ids)
    base_params = dict(tree_flatten(lm.model.parameters()))
    m = new_m2r2(lm, gates=[2, 4], rank=4, lora_targets=TARGETS[arch])
    _randomize(m)
    states, final, kv = m.slow_pass(ids)
    # the slow stream is the untouched base: same logits, same modules, same parameter names
    assert mx.array_equal(m.parts.head(final), base_logits).item()
    assert mx.array_equal(lm.model(ids), base_logits).item()
    assert dict(tree_flatten(lm.model.parameters())).keys() == base_params.keys()
    # while the fast stream moves away from it
    fast = m.fast_states(states, kv)
    assert not np.allclose(np.array(fast[0]), np.array(states[2]), atol=1e-3)


def test_lora_touches_only_the_interval_it_runs():
    lm = tiny_model("llama")
    m = new_m2r2(lm, gates=[2, 4], rank=4, lora_targets=["q_proj", "v_proj"])
    _randomize(m)
    # zero the deltas of layers 2..3: the second interval is then the base again
    for layer in m.lora[2:]:
        for proj in layer["self_attn"].values():
            proj.lora_b.weight = mx.zeros_like(proj.lora_b.weight)
    states, _, kv = m.slow_pass(_ids())
    fast = m.fast_states(states, kv)
    np.testing.assert_allclose(np.array(fast[1]), np.array(states[4]), atol=2e-5)
    assert not np.allclose(np.array(fast[0]), np.array(states[2]), atol=1e-3)


def test_lora_save_load_roundtrip(tmp_path):
    lm = tiny_model("llama")
    m = new_m2r2(lm, gates=[2, 4], rank=4, lora_targets=["q_proj", "down_proj"], lora_scale=0.5, arla=True, arla_dim=8)
    _randomize(m)
    names = [k for k, _ in tree_flatten(m.parameters())]
    assert "lora.3.self_attn.q_proj.lora_a.weight" in names and "lora.0.mlp.down_proj.lora_b.weight" in names
    again = load_adapters(lm, save_adapters(m, tmp_path / "lora"))
    assert again.config == m.config and again.config.adapter_form == "lora"
    for (n1, p1), (n2, p2) in zip(tree_flatten(m.parameters()), tree_flatten(again.parameters())):
        assert n1 == n2 and mx.array_equal(p1, p2).item()
    ids = _ids()
    s1, _, kv1 = m.slow_pass(ids)
    s2, _, kv2 = again.slow_pass(ids)
    for a, b in zip(m.fast_states(s1, kv1), again.fast_states(s2, kv2)):
        assert mx.array_equal(a, b).item()


def test_unknown_or_non_linear_targets_are_refused():
    with pytest.raises(M2R2Error, match="'qkv_proj' names no projection"):
        new_m2r2(tiny_model("llama"), gates=[2], lora_targets=["qkv_proj"])
    with pytest.raises(M2R2Error, match="not a linear projection"):
        new_m2r2(tiny_model("olmoe"), gates=[2], lora_targets=["gate_proj"])  # olmoe's experts


def test_lora_form_trains():
    from m2r2_mlx.training.trainer import Trainer

    lm = tiny_model("llama", seed=4)
    m = new_m2r2(lm, gates=[2, 4], rank=8, lora_targets=["q_proj", "v_proj", "up_proj", "down_proj"])
    trainer = Trainer(m, lr=3e-3, steps=20)
    ids = _ids(T=16, B=4, seed=5)
    before = trainer.eval_loss(ids)
    for _ in range(20):
        trainer.step(ids)
    assert trainer.eval_loss(ids) < 0.5 * before
    assert all(name.startswith("lora.") for name, _ in tree_flatten(m.trainable_parameters()))
