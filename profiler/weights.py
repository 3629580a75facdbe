"""What a component reads and computes per call, from the model's actual arrays (quantized or not).

A decode step on a small batch streams each weight it touches from memory once, whatever the number of positions:
its cost is the bytes of those arrays (packed 4-bit weights with their scales and biases count as they are
stored). Attention also reads every earlier position's keys and values. FLOPs are 2 per weight per position,
plus attention's scores and weighted sums.
"""

from __future__ import annotations

from dataclasses import dataclass

from m2r2_mlx.moe.blocks import top_k

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


def nbytes(module) -> int:
    return sum(a.nbytes for _, a in tree_flatten(module.parameters()))


def weight_count(module) -> int:
    """Weights (multiply-adds per position): a quantized layer's packed words hold 32 / bits weights each; its
    scales and biases are not weights."""
    total = 0
    for _, m in module.named_modules():
        own = {k: v for k, v in m.items() if isinstance(v, mx.array)}
        bits = getattr(m, "bits", None)
        for key, a in own.items():
            if bits and key == "weight":
                total += a.size * 32 // bits
            elif not (bits and key in ("scales", "biases")):
                total += a.size
    return total


@dataclass(frozen=True)
class Footprint:
    """One component's bytes and weights per call: ``fixed`` always read, ``per_unit`` for each expert (MoE)
    or each embedding row, up to ``units``."""

    fixed_bytes: int
    fixed_weights: int
    unit_bytes: int = 0
    unit_weights: int = 0
    units: int = 0  # experts in the block (or held in its slots); vocabulary rows for an embedding
    per_position: int = 0  # units one position reads (top-k experts; 1 embedding row)

    def cost(self, positions: int) -> tuple[int, int]:
        """(bytes, FLOPs) of a call over ``positions`` positions."""
        used = min(self.units, self.per_position * positions) if self.units else 0
        read = self.fixed_bytes + used * self.unit_bytes
        flops = 2 * positions * (self.fixed_weights + self.per_position * self.unit_weights)
        return read, flops


def dense(module) -> Footprint:
    return Footprint(nbytes(module), weight_count(module))


def embedding(module) -> Footprint:
    """A lookup reads one row per position (no multiply-adds)."""
    rows = int(module.weight.shape[0])
    return Footprint(0, 0, nbytes(module) // rows, 0, rows, 1)


def block(module) -> Footprint:
    """A feed-forward block: dense, or a mixture of experts (a SwitchGLU ``switch_mlp``, or an expert cache's
    slots in its place) where a position reads its top-k experts only."""
    switch = module.get("switch_mlp") if isinstance(module, nn.Module) else None
    if switch is None:
        return dense(module)
    experts = switch.get("inner", switch)  # an offloaded block computes on the cache's slot tensors
    leaves = tree_flatten(experts.parameters())
    units = int(leaves[0][1].shape[0])
    total_bytes, total_weights = nbytes(module), weight_count(module)
    expert_bytes, expert_weights = nbytes(experts), weight_count(experts)
    return Footprint(
        total_bytes - expert_bytes,
        total_weights - expert_weights,
        expert_bytes // units,
        expert_weights // units,
        units,
        top_k(module) or units,
    )


def kv_bytes_per_position(cache) -> int:
    """Bytes of keys and values one position holds in a layer's cache (0 before anything was stored). Views onto
    a cache (the fast stream's) are unwrapped; quantized caches count their packed arrays and scales."""
    while hasattr(cache, "cache") and not hasattr(cache, "keys"):
        cache = cache.cache
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    if keys is None or values is None:
        return 0
    leaves = [a for a in tree_flatten([keys, values]) if isinstance(a[1], mx.array)]
    return sum(a.nbytes // max(int(a.shape[-2]), 1) for _, a in leaves)
