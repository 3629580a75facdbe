"""Charging a real forward pass to a ``DeviceClock``: each op the model calls, at the device's roofline.

``with metered(clock, Metering(weight_bytes=0.5625), model):`` swaps the modules of ``model`` (one instance, and any
other module trees passed beside it: a predictor's own weights) for metered wrappers, as mlx-lm's LoRA tuner swaps
in its layers (``update_modules``), and puts the originals back when the block ends. Each call of a projection
(``Linear``, ``QuantizedLinear``, ``SwitchLinear``, ``QuantizedSwitchLinear``), an embedding (and a tied head), a
rotary embedding and a norm then advances the clock's compute stream by that op's time on the device, in the order
the model calls them. The attention kernel runs inside mlx-lm's attention module (``self_attn``), through
``mx.fast``: its wrapper hands the module a KV cache that charges the kernel when the module fetches the keys and
values it will attend over, which is just before the kernel runs. Nothing outside the instances passed is touched.

An op's bytes are the weights it reads, as the device stores them (``weight_bytes`` per weight: a 4-bit model on a
laptop reads 0.5625 bytes a weight whatever this machine holds; None: as held), plus the KV cache an attention reads
(``kv_bytes`` per element); its FLOPs are 2 per weight per row. A gathered expert matmul reads each distinct expert
once, however many rows use it (a fused row rides free of bytes). The kernels a decoder layer launches that are not
metered one by one (cache writes, residual adds, activations, the router's softmax, top-k and combine) are charged
as ``other_kernels`` launches with each norm. Each op has a kind ("matmul", "gather", "attention", "rope", "norm"),
by which a device may price it differently (clock.py).

A small stand-in model can be priced at a deployed model's scale: every decoder-layer weight as ``weight_scale``
weights (the ratio of their experts' sizes), the embedding, head and KV cache ``width_scale`` wider (the ratio of
their hidden sizes). The routes, and so every cache decision, stay the stand-in's own.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm.models import rope_utils
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from .clock import DeviceClock

ACTIVATION_BYTES = 2  # activations are small at batch 1; their bytes hardly matter
ATTENTION = "self_attn"  # mlx-lm's name for every model's attention module
ROPES = (nn.RoPE, *(getattr(rope_utils, n) for n in dir(rope_utils) if n.endswith("RoPE")))


@dataclass(frozen=True)
class Metering:
    weight_bytes: float | None = None  # bytes per weight on the device (None: as held here)
    kv_bytes: float | None = None  # bytes per KV-cache element on the device (None: as held here)
    other_kernels: int = 7  # unmetered kernels charged with each norm (two norms per decoder layer)
    weight_scale: float = 1.0  # each decoder-layer weight priced as this many (a stand-in at a larger model's scale)
    width_scale: float = 1.0  # embedding, head and KV cache priced this much wider


def _weights(module: nn.Module, per_expert: bool = False) -> tuple[int, int]:
    """(weights, bytes held here) of one matrix (or one expert's, ``per_expert``): a quantized module packs
    32 / bits weights into each uint32 and adds scales and biases per group."""
    w = module["weight"]
    out_dim, packed = w.shape[-2], w.shape[-1]
    in_dim = packed * 32 // module.bits if "scales" in module else packed
    held = sum(module[k].nbytes for k in ("weight", "scales", "biases") if k in module and module[k] is not None)
    if per_expert:
        held //= w.shape[0]
    return out_dim * in_dim, held


class _Meter:
    """What each op is charged: ``clock.op(bytes, flops, kind)``."""

    def __init__(self, clock: DeviceClock, m: Metering):
        self.clock, self.m = clock, m

    def weights(self, count: int, held: int, scale: float | None = None) -> float:
        scale = self.m.weight_scale if scale is None else scale
        return scale * (held if self.m.weight_bytes is None else count * self.m.weight_bytes)

    def matmul(self, module: nn.Module, x: mx.array, *_) -> None:
        count, held = _weights(module)
        rows = math.prod(x.shape[:-1])
        activations = rows * (x.shape[-1] + count // x.shape[-1]) * ACTIVATION_BYTES
        self.clock.op(self.weights(count, held) + activations, 2 * rows * count * self.m.weight_scale, "matmul")

    def gathered(self, module: nn.Module, x: mx.array, indices: mx.array, *_) -> None:
        count, held = _weights(module, per_expert=True)
        ids = np.array(indices)  # already on the host: the cache read the routes before this matmul
        nbytes = len(np.unique(ids)) * self.weights(count, held)
        self.clock.op(nbytes, 2 * ids.size * count * self.m.weight_scale, "gather")

    def embedding(self, module: nn.Module, x: mx.array) -> None:
        dims = module["weight"].shape[-1] * (32 // module.bits if "scales" in module else 1)
        self.clock.op(x.size * dims * (self.m.weight_bytes or module["weight"].dtype.size) * self.m.width_scale)

    def head(self, module: nn.Module, x: mx.array) -> None:
        """A tied head (the embedding as a linear map): its weights priced ``width_scale`` wider."""
        count, held = _weights(module)
        rows, s = math.prod(x.shape[:-1]), self.m.width_scale
        self.clock.op(self.weights(count, held, s), 2 * rows * count * s, "matmul")

    def norm(self, module: nn.Module, x: mx.array) -> None:
        self.clock.op(2 * x.size * ACTIVATION_BYTES, kind="norm")
        for _ in range(self.m.other_kernels):
            self.clock.op(0)

    def rope(self, module: nn.Module, x: mx.array, *_) -> None:
        self.clock.op(2 * x.size * ACTIVATION_BYTES, kind="rope")

    def attention(self, q_shape: tuple[int, ...], k: mx.array, v: mx.array) -> None:
        per = (self.m.kv_bytes or k.dtype.size) * self.m.width_scale
        b, h, lq, d = q_shape
        self.clock.op((k.size + v.size) * per, 4 * b * h * lq * k.shape[-2] * d * self.m.width_scale, "attention")


# (classes whose own method a wrapper meters, the method, what it is charged); a module qualifies when its class
# runs that very method (a subclass that overrides it is someone else's op)
_CHARGES = (
    ((nn.Linear, nn.QuantizedLinear), "__call__", "matmul"),
    ((SwitchLinear, QuantizedSwitchLinear), "__call__", "gathered"),
    ((nn.Embedding, nn.QuantizedEmbedding), "__call__", "embedding"),
    ((nn.RMSNorm,), "__call__", "norm"),
    (ROPES, "__call__", "rope"),
)


def _kind(module: nn.Module) -> str | None:
    for owners, method, kind in _CHARGES:
        if any(getattr(type(module), method, None) is getattr(o, method) for o in owners):
            return kind
    return None


class _Metered(nn.Module):
    """A module whose calls are charged to the meter first; every other attribute is the wrapped module's."""

    def __init__(self, inner: nn.Module, meter: _Meter, kind: str, around: Callable | None):
        super().__init__()
        self.inner = inner
        self._meter, self._kind = meter, kind
        self._call = self._charged(inner, getattr(meter, kind))
        self._call = around(self._call, kind) if around else self._call

    @staticmethod
    def _charged(f, charge):
        def call(*args, **kwargs):
            charge(f, *args)
            return f(*args, **kwargs)

        return call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def as_linear(self, x: mx.array) -> mx.array:  # a tied head
        charge = self._charged(self.inner.as_linear, lambda _, *a: self._meter.head(self.inner, *a))
        return charge(x)

    def __getattr__(self, key: str):  # the model reads its modules' attributes (weight, bits, dims, ...)
        try:
            return super().__getattr__(key)
        except AttributeError:
            if "inner" not in self:  # still being built
                raise
            return getattr(self["inner"], key)


class _FetchingKV:
    """A KV cache that charges the attention kernel when the attention module fetches the keys and values: the
    kernel that attends over them comes next. Everything else is the wrapped cache's."""

    def __init__(self, cache, attention: "_MeteredAttention"):
        self._cache, self._attention = cache, attention

    def update_and_fetch(self, keys, values):
        keys, values = self._cache.update_and_fetch(keys, values)
        self._attention.fetched(keys, values)
        return keys, values

    def __getattr__(self, key: str):
        return getattr(self._cache, key)


class _AttentionCall:
    """What one call of an attention module has shown so far."""

    def __init__(self):
        self.ropes: list[tuple[int, ...]] = []  # shapes its rotary embeddings saw: the queries', then the keys'
        self.charged = False


class _MeteredAttention(nn.Module):
    """An attention module whose kernel (``mx.fast``'s, inside the module) is charged: the queries' shape is read at
    their rotary embedding (the module's first), the keys and values when it fetches them from its KV cache."""

    def __init__(self, inner: nn.Module, meter: _Meter, around: Callable | None):
        super().__init__()
        self.inner = inner
        self._meter, self._around = meter, around
        self._call = _AttentionCall()

    def rotated(self, x: mx.array) -> None:
        self._call.ropes.append(x.shape)

    def fetched(self, k, v) -> None:
        call = self._call
        if isinstance(k, mx.array) and call.ropes and not call.charged:  # a quantized cache runs no mx.fast kernel
            call.charged = True
            self._meter.attention(call.ropes[0], k, v)

    def __call__(self, x, mask=None, cache=None, **kwargs):
        self._call = _AttentionCall()
        run = self._run if self._around is None else self._around(self._run, "attention")
        return run(x, mask, _FetchingKV(cache, self) if cache is not None else None, **kwargs)

    def _run(self, x, mask, cache, **kwargs):
        out = self.inner(x, mask, cache=cache, **kwargs)
        call = self._call
        if not call.charged and len(call.ropes) >= 2:  # no cache: the keys are the rotated ones, as long
            k = mx.zeros(call.ropes[1], mx.float16)  # only its shape (and its dtype's size) is read
            self._meter.attention(call.ropes[0], k, k)
        return out

    def __getattr__(self, key: str):
        try:
            return super().__getattr__(key)
        except AttributeError:
            if "inner" not in self:
                raise
            return getattr(self["inner"], key)


class _MeteredRoPE(_Metered):
    """A rotary embedding: charged, and its input's shape told to the attention module it belongs to."""

    def __init__(self, inner, meter, attention: _MeteredAttention | None, around):
        super().__init__(inner, meter, "rope", around)
        self._attention = attention

    def __call__(self, x, *args, **kwargs):
        if self._attention is not None:
            self._attention.rotated(x)
        return self._call(x, *args, **kwargs)


def _swaps(root: nn.Module, meter: _Meter, around) -> tuple[list, list]:
    """(leaf swaps, attention swaps) for one module tree: (path, original, wrapper) each."""
    leaves, attentions = [], []
    by_path = dict(root.named_modules())
    owner = {}
    for path, module in by_path.items():
        if path.rsplit(".", 1)[-1] == ATTENTION and not isinstance(module, (_Metered, _MeteredAttention)):
            wrapper = _MeteredAttention(module, meter, around)
            attentions.append((path, module, wrapper))
            owner[path] = wrapper
    for path, module in by_path.items():
        if path == "" or isinstance(module, (_Metered, _MeteredAttention)) or path.split(".")[-1] == "inner":
            continue
        kind = _kind(module)
        if kind is None:
            continue
        if kind == "rope":
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            leaves.append((path, module, _MeteredRoPE(module, meter, owner.get(parent), around)))
        else:
            leaves.append((path, module, _Metered(module, meter, kind, around)))
    return leaves, attentions


def _swap(root: nn.Module, pairs: list[tuple[str, nn.Module]]) -> None:
    if pairs:
        root.update_modules(tree_unflatten(pairs))


@contextmanager
def metered(clock: DeviceClock, metering: Metering, *modules: nn.Module, around=None) -> Iterator[None]:
    """Charge every metered op that ``modules`` (a model, and any module trees it runs beside it) call inside the
    block to ``clock``; see the module docstring. ``around(call, kind)``: a wrapper for each charged call
    (insitu.py times each op where the model calls it)."""
    meter = _Meter(clock, metering)
    done = []
    try:
        for root in modules:
            if _kind(root) is not None:  # a lone layer: nothing to swap it in, so it is charged through a wrapper
                raise TypeError("meter a module inside a model (pass the model), not a lone layer")
            leaves, attentions = _swaps(root, meter, around)
            _swap(root, [(p, w) for p, _, w in leaves])  # first the leaves, inside the attention modules too
            done.append((root, leaves, []))
            _swap(root, [(p, w) for p, _, w in attentions])
            done[-1] = (root, leaves, attentions)
        yield
    finally:
        for root, leaves, attentions in reversed(done):
            _swap(root, [(p, m) for p, m, _ in attentions])
            _swap(root, [(p, m) for p, m, _ in leaves])
