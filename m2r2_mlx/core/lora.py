"""The "lora" adapter form: low-rank deltas on a layer's projections, live in the fast stream only.

A targeted projection W of a fast-stream layer becomes W x + scale * B(A(x)) while
M2R2Model.fast_layers runs, and is the base's own module again the moment it
returns: the deltas are swapped in for the duration of the call instead of
wrapping the base for good, so the slow stream (and anything else that calls the
base) is the untouched base model, module for module.

Names and layouts follow PEFT, so its checkpoints map one to one: ``lora_a``
(rank, in) and ``lora_b`` (out, rank), both in nn.Linear's (out, in) layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten

from ..errors import M2R2Error


class LoRADelta(nn.Module):
    """scale * lora_b(lora_a(x)); ``lora_b`` starts at zero, so a fresh delta changes nothing."""

    def __init__(self, in_dims: int, out_dims: int, rank: int, scale: float):
        super().__init__()
        self.lora_a = nn.Linear(in_dims, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_dims, bias=False)
        self.lora_b.weight = mx.zeros_like(self.lora_b.weight)
        self.scale = scale

    def __call__(self, x: mx.array) -> mx.array:
        return self.scale * self.lora_b(self.lora_a(x))


class WithDelta(nn.Module):
    """A base projection plus its delta: stands in for the projection during a fast-stream call."""

    def __init__(self, base: nn.Module, delta: LoRADelta):
        super().__init__()
        self.base = base
        self.delta = delta

    def __call__(self, x: mx.array) -> mx.array:
        return self.base(x) + self.delta(x)


def projection_dims(module) -> tuple[int, int] | None:
    """(in, out) features of a linear projection (plain or quantized); None for anything else."""
    if isinstance(module, nn.QuantizedLinear):
        out_dims, packed = module.weight.shape
        return packed * 32 // module.bits, out_dims
    if isinstance(module, nn.Linear):
        out_dims, in_dims = module.weight.shape
        return in_dims, out_dims
    return None


def new_lora_deltas(layers, targets: list[str], rank: int, scale: float) -> list[dict]:
    """Zero-initialised deltas for each of ``layers``: nested dicts that mirror the layer's module
    paths, so parameter names read like the base's (``self_attn.q_proj.lora_a.weight``).

    A target is a projection's own name (PEFT's ``target_modules``); it must name a
    linear projection in at least one layer.
    """
    deltas, matched = [], set()
    for i, layer in enumerate(layers):
        tree: dict = {}
        for path, module in layer.named_modules():
            name = path.rsplit(".", 1)[-1]
            if name not in targets:
                continue
            dims = projection_dims(module)
            if dims is None:
                raise M2R2Error(
                    f"LoRA target {path!r} of layer {i} is a {type(module).__name__}, not a linear projection; "
                    "choose linear projections as targets"
                )
            node = tree
            for part in path.split(".")[:-1]:
                node = node.setdefault(part, {})
            node[name] = LoRADelta(*dims, rank, scale)
            matched.add(name)
        deltas.append(tree)
    unmatched = [t for t in targets if t not in matched]
    if unmatched:
        names = (
            sorted({p.rsplit(".", 1)[-1] for p, m in layers[0].named_modules() if projection_dims(m)}) if layers else []
        )
        raise M2R2Error(
            f"LoRA target {unmatched[0]!r} names no projection of the base's layers (they have: {', '.join(names)})"
        )
    return deltas


class LoRASwitch:
    """Where each layer's deltas attach, and the switch that attaches them for one fast-stream call.

    A plain object, not an nn.Module: it points into the base model, whose weights
    must not become M2R2 parameters.
    """

    def __init__(self, layers, deltas: list[dict]):
        self.sites = []
        for layer, tree in zip(layers, deltas):
            sites = []
            for path, delta in tree_flatten(tree, is_leaf=lambda m: isinstance(m, LoRADelta)):
                *parents, name = path.split(".")
                parent = layer
                for part in parents:
                    parent = parent[part]
                sites.append((parent, name, delta))
            self.sites.append(sites)

    @contextmanager
    def active(self, start: int, stop: int) -> Iterator[None]:
        """Layers start..stop-1 carry their deltas inside the block, and are the base's own after it."""
        swapped = []
        try:
            for sites in self.sites[start:stop]:
                for parent, name, delta in sites:
                    original = parent[name]
                    parent[name] = WithDelta(original, delta)
                    swapped.append((parent, name, original))
            yield
        finally:
            for parent, name, original in reversed(swapped):
                parent[name] = original
