"""Charging a real forward pass to a ``DeviceClock``: each op the model calls, at the device's roofline.

``with metered(clock, Metering(weight_bytes=0.5625)):`` every call of an mlx-lm projection (``Linear``,
``QuantizedLinear``, ``SwitchLinear``, ``QuantizedSwitchLinear``), embedding (and tied head), attention kernel,
rotary embedding and norm inside the block advances the clock's compute stream by that op's time on the device, in
the order the model calls them. An op's bytes are the weights it reads, as the device stores them (``weight_bytes``
per weight: a 4-bit model on a laptop reads 0.5625 bytes a weight whatever this machine holds; None: as held), plus
the KV
cache an attention reads (``kv_bytes`` per element); its FLOPs are 2 per weight per row. A gathered expert matmul
reads each distinct expert once, however many rows use it (a fused row rides free of bytes). The kernels a decoder
layer launches that are not metered one by one (cache writes, residual adds, activations, the router's softmax,
top-k and combine) are charged as ``other_kernels`` launches with each norm. Each op has a kind ("matmul",
"gather", "attention", "rope", "norm"), by which a device may price it differently (clock.py).

A small stand-in model can be priced at a deployed model's scale: every decoder-layer weight as ``weight_scale``
weights (the ratio of their experts' sizes), the embedding, head and KV cache ``width_scale`` wider (the ratio of
their hidden sizes). The routes, and so every cache decision, stay the stand-in's own.

The patch is process-wide while the block runs (the classes' ``__call__``), so a device-clock run must not share
the process with other decoding threads.
"""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from .clock import DeviceClock

ACTIVATION_BYTES = 2  # activations are small at batch 1; their bytes hardly matter


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
    def __init__(self, clock: DeviceClock, m: Metering):
        self.clock, self.m = clock, m

    def weights(self, count: int, held: int, scale: float | None = None) -> float:
        scale = self.m.weight_scale if scale is None else scale
        return scale * (held if self.m.weight_bytes is None else count * self.m.weight_bytes)

    def matmul(self, module: nn.Module, x: mx.array) -> None:
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

    def attention(self, q: mx.array, k: mx.array, v: mx.array, *_) -> None:
        per = (self.m.kv_bytes or k.dtype.size) * self.m.width_scale
        b, h, lq, d = q.shape
        self.clock.op((k.size + v.size) * per, 4 * b * h * lq * k.shape[-2] * d * self.m.width_scale, "attention")

    def norm(self, module: nn.Module, x: mx.array) -> None:
        self.clock.op(2 * x.size * ACTIVATION_BYTES, kind="norm")
        for _ in range(self.m.other_kernels):
            self.clock.op(0)

    def head(self, module: nn.Module, x: mx.array) -> None:
        """A tied head (the embedding as a linear map): its weights priced ``width_scale`` wider."""
        count, held = _weights(module)
        rows, s = math.prod(x.shape[:-1]), self.m.width_scale
        self.clock.op(self.weights(count, held, s), 2 * rows * count * s, "matmul")

    def rope(self, x: mx.array, *_) -> None:
        self.clock.op(2 * x.size * ACTIVATION_BYTES, kind="rope")


def _charging(f, charge):
    """``f`` that first charges its call to the clock (``charge`` takes the same positional arguments)."""

    def call(*args, **kwargs):
        charge(*args)
        return f(*args, **kwargs)

    return call


@contextmanager
def metered(clock: DeviceClock, metering: Metering = Metering(), around=None) -> Iterator[None]:
    """Charge every metered op called inside the block to ``clock``; see the module docstring. ``around``: a
    wrapper for each charged call (insitu.py times each op where the model calls it)."""
    meter = _Meter(clock, metering)
    charges = [
        ((nn.Linear, nn.QuantizedLinear), "__call__", meter.matmul),
        ((SwitchLinear, QuantizedSwitchLinear), "__call__", meter.gathered),
        ((nn.Embedding, nn.QuantizedEmbedding), "__call__", meter.embedding),
        ((nn.Embedding, nn.QuantizedEmbedding), "as_linear", meter.head),
        ((nn.RMSNorm,), "__call__", meter.norm),
        ((mx.fast,), "scaled_dot_product_attention", meter.attention),
        ((mx.fast,), "rope", meter.rope),
    ]
    with ExitStack() as stack:
        for owners, name, charge in charges:
            for owner in owners:
                original = getattr(owner, name)
                call = _charging(original, charge)
                setattr(owner, name, around(call) if around else call)
                stack.callback(setattr, owner, name, original)
        yield
