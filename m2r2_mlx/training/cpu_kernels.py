"""Faster float32 kernels for MLX's CPU backend, for training and self-distillation only.

On Linux, MLX's CPU backend computes ``exp`` (and so sigmoid, SiLU and softmax) one
scalar at a time: about 100M elements/s, slower than the matmuls around it. In a
SmolLM2 layer over 1,024 tokens the SwiGLU activation and the attention softmax
then cost as much as all the projections together. Here ``exp`` is computed from
plain arithmetic instead (2^n by exponent bits, 2^f by a degree-7 polynomial; relative
error below 3e-7), with hand-written gradients, and attention is written to group
the query heads that share a key head rather than copy the keys per head.

``fast_kernels(model)`` swaps a model's llama feed-forward and attention blocks for
ones that call these (``update_modules``, as mlx-lm's LoRA tuner swaps layers) inside a
``with`` block, and the originals back on exit. m2r2-train uses it on
the CPU for self-distillation and the training steps, never for decoding or
evaluation: the chat and the benchmarks run MLX's own kernels, bit for bit.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models import llama
from mlx_lm.models.base import scaled_dot_product_attention

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@mx.compile
def _exp(x: mx.array) -> mx.array:
    y = mx.clip(x, -87.0, 88.0) * _LOG2E
    n = mx.floor(y + 0.5)
    f = (y - n) * _LN2  # |f| <= ln(2) / 2: the Taylor series to degree 7 is within 3e-7
    p = 1.0 + f * (1.0 + f * (0.5 + f * (1 / 6 + f * (1 / 24 + f * (1 / 120 + f * (1 / 720 + f / 5040))))))
    return p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32)  # p * 2^n


@mx.custom_function
def fast_exp(x: mx.array) -> mx.array:
    return _exp(x)


@fast_exp.vjp
def _fast_exp_vjp(primals, cotangent, output):
    return cotangent * output


@mx.compile
def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    return gate * x / (1.0 + _exp(-gate))


@mx.compile
def _swiglu_grads(gate: mx.array, x: mx.array, cotangent: mx.array):
    s = 1.0 / (1.0 + _exp(-gate))
    return cotangent * x * s * (1.0 + gate * (1.0 - s)), cotangent * gate * s


@mx.custom_function
def fast_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x, as mlx-lm's ``swiglu``."""
    return _swiglu(gate, x)


@fast_swiglu.vjp
def _fast_swiglu_vjp(primals, cotangent, output):
    return _swiglu_grads(*primals, cotangent)


def fast_sdpa(queries, keys, values, cache=None, scale: float = 1.0, mask=None, sinks=None):
    """mlx-lm's ``scaled_dot_product_attention`` (B, H, L, D) with grouped query heads and ``fast_exp``.

    Masks: None, "causal" (aligned to the end of the keys, as MLX's), a boolean array (True
    = attend) or an additive array. Quantized caches and attention sinks go to mlx-lm's own.
    """
    if sinks is not None or hasattr(cache, "bits"):
        return scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)
    B, H, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    rep = H // Hk
    q = (queries * scale).reshape(B, Hk, rep * L, D)  # query heads of one key head side by side: no key copies
    scores = (q @ keys.swapaxes(-1, -2)).reshape(B, Hk, rep, L, S)
    if isinstance(mask, str):
        mask = mx.arange(S)[None, :] <= mx.arange(L)[:, None] + (S - L)
    elif mask is not None and mask.ndim > 2:  # (.., H or 1, L, S), e.g. batched prompts' padding masks
        mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
        mask = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(mask.shape[0], Hk, rep, L, S)
    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(-1e30, scores.dtype))
        else:
            scores = scores + mask
    scores = scores - mx.stop_gradient(scores.max(-1, keepdims=True))
    p = fast_exp(scores)
    p = (p / p.sum(-1, keepdims=True)).reshape(B, Hk, rep * L, S)
    return (p @ values).reshape(B, H, L, D)


class FastMLP(nn.Module):
    """mlx-lm's llama feed-forward block with ``fast_swiglu``: the same projections, a faster activation."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.inner = mlp

    def __call__(self, x: mx.array) -> mx.array:
        m = self.inner
        return m.down_proj(fast_swiglu(m.gate_proj(x), m.up_proj(x)))


class FastAttention(nn.Module):
    """mlx-lm's llama attention with ``fast_sdpa``: the same projections, rotary embedding and cache writes."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.inner = attention

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        a, (B, L, _) = self.inner, x.shape
        q, k, v = (p(x).reshape(B, L, n, -1).transpose(0, 2, 1, 3) for p, n in self._heads(a))
        offset = {} if cache is None else {"offset": cache.offset}
        q, k = a.rope(q, **offset), a.rope(k, **offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = fast_sdpa(q, k, v, cache=cache, scale=a.scale, mask=mask)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    @staticmethod
    def _heads(a):
        return ((a.q_proj, a.n_heads), (a.k_proj, a.n_kv_heads), (a.v_proj, a.n_kv_heads))


def _swaps(model) -> tuple[list, list]:
    """(path, fast module) and (path, original) for each llama-shaped block of ``model``: other architectures keep
    MLX's kernels."""
    fast, originals = [], []
    for i, layer in enumerate(model.model.layers):
        for name, kind, wrap in (("mlp", llama.MLP, FastMLP), ("self_attn", llama.Attention, FastAttention)):
            if type(layer.get(name)) is kind:
                path = f"model.layers.{i}.{name}"
                fast.append((path, wrap(layer[name])))
                originals.append((path, layer[name]))
    return fast, originals


@contextmanager
def fast_kernels(model, enabled: bool = True) -> Iterator[bool]:
    """Within the block, ``model``'s llama feed-forward and attention blocks run the kernels above (CPU only;
    elsewhere a no-op): swapped in as modules and back on exit. Yields whether any are in use."""
    if not enabled or mx.default_device().type != mx.cpu or not hasattr(getattr(model, "model", None), "layers"):
        yield False
        return
    fast, originals = _swaps(model)
    model.update_modules(tree_unflatten(fast))
    try:
        yield bool(fast)
    finally:
        model.update_modules(tree_unflatten(originals))
