"""The CPU training kernels: exp, SwiGLU and attention equal MLX's own, values and gradients,
and the swap into mlx-lm models is undone on exit."""

from m2r2_mlx.training.cpu_kernels import FastAttention, FastMLP, fast_exp, fast_kernels, fast_sdpa, fast_swiglu

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from .tiny import tiny_model


def test_exp_relative_error_and_gradient():
    x = mx.linspace(-80.0, 80.0, 200_001)
    rel = mx.abs(fast_exp(x) - mx.exp(x)) / mx.exp(x)
    assert rel.max().item() < 1e-6
    assert fast_exp(mx.array([-200.0])).item() < 1e-37  # underflows quietly, no garbage
    g = mx.grad(lambda v: fast_exp(v).sum())(x[::1000])
    np.testing.assert_allclose(np.array(g), np.array(mx.exp(x[::1000])), rtol=1e-6)


def test_swiglu_values_and_gradients():
    mx.random.seed(0)
    gate, x, ct = (mx.random.normal((3, 7, 96)) * 4 for _ in range(3))
    ref = lambda g, v: nn.silu(g) * v  # noqa: E731
    np.testing.assert_allclose(np.array(fast_swiglu(gate, x)), np.array(ref(gate, x)), atol=1e-5, rtol=1e-5)
    want = mx.vjp(ref, [gate, x], [ct])[1]
    got = mx.vjp(fast_swiglu, [gate, x], [ct])[1]
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4, rtol=1e-4)


def _masks(L, S):
    i, j = mx.arange(L)[:, None], mx.arange(S)[None, :]
    boolean = mx.concatenate([j[:, : S - L] < i + 0, j[:, :L] == i], axis=1) if S == 2 * L else j <= i + (S - L)
    return [None, "causal", boolean, mx.where(boolean, 0.0, -1e9).astype(mx.float32)]


@pytest.mark.parametrize("heads, kv_heads, L, S", [(4, 2, 5, 5), (6, 3, 1, 9), (4, 4, 3, 7), (6, 2, 4, 8)])
def test_attention_equals_mlx_for_every_mask(heads, kv_heads, L, S):
    mx.random.seed(1)
    q = mx.random.normal((2, heads, L, 16))
    k, v = mx.random.normal((2, kv_heads, S, 16)), mx.random.normal((2, kv_heads, S, 16))
    padding = mx.random.uniform(shape=(2, 1, L, S)) > 0.3  # per-sequence masks, as batched prompts have
    padding[..., -1] = True  # every query sees at least one key
    per_head = mx.random.uniform(shape=(1, heads, L, S)) > 0.3
    per_head[..., -1] = True
    for mask in _masks(L, S) + [padding, per_head, padding[0]]:
        want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        got = fast_sdpa(q, k, v, scale=0.25, mask=mask)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, err_msg=str(mask))
    # gradients through the whole attention, for the trainer
    f = lambda a, b, c: fast_sdpa(a, b, c, scale=0.25, mask="causal").sum()  # noqa: E731
    g = lambda a, b, c: mx.fast.scaled_dot_product_attention(a, b, c, scale=0.25, mask="causal").sum()  # noqa: E731
    for a, b in zip(mx.grad(f, argnums=(0, 1, 2))(q, k, v), mx.grad(g, argnums=(0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


def test_model_under_fast_kernels_matches_and_is_restored():
    lm = tiny_model("llama", seed=3)
    ids = mx.array([[1, 5, 9, 2, 7, 3, 3, 8]])
    before = lm.model(ids)
    layer = lm.model.model.layers[0]
    original = (layer.mlp, layer.self_attn)
    with fast_kernels(lm.model) as on:
        assert on and isinstance(layer.mlp, FastMLP) and isinstance(layer.self_attn, FastAttention)
        assert layer.mlp.inner is original[0] and layer.self_attn.inner is original[1]
        during = lm.model(ids)
    assert layer.mlp is original[0] and layer.self_attn is original[1]  # the model's own modules, back
    np.testing.assert_allclose(np.array(during), np.array(before), atol=1e-4)
    with fast_kernels(lm.model, enabled=False) as on:
        assert not on and layer.mlp is original[0]
