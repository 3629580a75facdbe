"""The PyTorch fast stream over transformers decoders computes what the MLX fast stream computes over mlx-lm's,
on the same weights (float32): slow states, exit states at every gate, with bottleneck or LoRA adapters, a context
feature and ARLA."""

from m2r2_mlx.core.adapters import config_for_base
from m2r2_mlx.core.arla import exit_stats
from m2r2_mlx.core.fast_stream import M2R2Model

import mlx.core as mx
import numpy as np
import pytest

from .tiny import random_ids, randomize

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from m2r2_torch.fast_stream import M2R2Torch  # noqa: E402  (after the skip: needs torch)
from m2r2_torch.modules import exit_stats as t_exit_stats  # noqa: E402

from .torch_tiny import mlx_state, tiny_hf  # noqa: E402

GATES = [2, 4]
ATOL = 1e-4


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    return {arch: tiny_hf(arch, tmp_path_factory.mktemp(arch)) for arch in ("llama", "phi3", "olmoe")}


def pair(bases, arch, **fields):
    """MLX adapters with every weight random, and the PyTorch fast stream given the same weights."""
    hf, lm = bases[arch]
    m2r2 = M2R2Model(lm.model, config_for_base(lm, GATES, **fields))
    randomize(m2r2, scale=0.1)
    model = M2R2Torch(hf, m2r2.config)
    model.m2r2.load_state_dict(mlx_state(m2r2), strict=True)
    return m2r2, model


def assert_same_states(m2r2, model, ids=None):
    ids = random_ids(T=11, B=2) if ids is None else ids
    states, final, kv = m2r2.slow_pass(ids)
    fast = m2r2.fast_states(states, kv)
    t_ids = torch.tensor(np.array(ids))
    with torch.no_grad():
        t_states, t_final, t_kv = model.slow_pass(t_ids)
        t_fast = model.fast_states(t_states, t_kv)
    np.testing.assert_allclose(t_final.numpy(), np.array(final), atol=ATOL)
    for g in GATES:
        np.testing.assert_allclose(t_states[g].numpy(), np.array(states[g]), atol=ATOL)
    for j, (a, b) in enumerate(zip(t_fast, fast)):
        assert np.abs(np.array(b) - np.array(states[GATES[j]])).max() > 1e-2, "the adapters should move the state"
        np.testing.assert_allclose(a.numpy(), np.array(b), atol=ATOL, err_msg=f"gate {GATES[j]}")
        np.testing.assert_allclose(model.parts.head(a).numpy(), np.array(m2r2.parts.head(b)), atol=ATOL)
    return fast, t_fast


@pytest.mark.parametrize("arch", ["llama", "phi3", "olmoe"])
def test_bottleneck_exit_states_equal_mlx(bases, arch):
    assert_same_states(*pair(bases, arch, adapter_rank=[8, 4], context_feature=True))


@pytest.mark.parametrize(
    ("arch", "targets"), [("llama", ["q_proj", "v_proj", "down_proj"]), ("phi3", ["qkv_proj", "gate_up_proj"])]
)
def test_lora_exit_states_equal_mlx(bases, arch, targets):
    m2r2, model = pair(bases, arch, adapter_form="lora", adapter_rank=4, lora_targets=targets, lora_scale=2.0)
    assert_same_states(m2r2, model)
    # outside the fast stream the base is its own again: the slow pass did not see the deltas
    hf, lm = bases[arch]
    ids = random_ids(T=7, B=1)
    with torch.no_grad():
        logits = hf(torch.tensor(np.array(ids))).logits.numpy()
    np.testing.assert_allclose(logits, np.array(lm.model(ids)), atol=ATOL)


def test_arla_logits_equal_mlx(bases):
    m2r2, model = pair(bases, "llama", adapter_rank=4, arla=True, arla_dim=8, arla_exit_stats=True)
    fast, t_fast = assert_same_states(m2r2, model)
    arla, t_arla = m2r2.arla, model.m2r2.arla
    zs = mx.stack([arla.latent(h, j, exit_stats(m2r2.parts.head(h))) for j, h in enumerate(fast)], axis=-2)
    with torch.no_grad():
        t_zs = torch.stack([t_arla.latent(h, j, t_exit_stats(model.parts.head(h))) for j, h in enumerate(t_fast)], -2)
        np.testing.assert_allclose(t_arla.logits_all(t_zs).numpy(), np.array(arla.logits_all(zs)), atol=ATOL)
        np.testing.assert_allclose(t_arla(t_zs).numpy(), np.array(arla(zs)), atol=ATOL)


def test_zero_adapters_leave_the_base(bases):
    """Fresh adapters (zero ``up``, zero context projection) exit exactly where the base is at each gate."""
    hf, lm = bases["olmoe"]
    model = M2R2Torch(hf, config_for_base(lm, GATES, adapter_rank=4, context_feature=True))
    ids = torch.tensor(np.array(random_ids(T=9, B=2)))
    with torch.no_grad():
        states, _, kv = model.slow_pass(ids)
        for g, h in zip(GATES, model.fast_states(states, kv)):
            torch.testing.assert_close(h, states[g], atol=1e-5, rtol=1e-5)
