"""Finding the mixture-of-experts parts of any mlx-lm model built on SwitchGLU.

mlx-lm stores each MoE layer's experts stacked in one ``SwitchGLU`` (``switch_mlp``) inside
the layer's sparse block, whatever the block is called (``mlp`` in olmoe/qwen2_moe,
``block_sparse_moe`` in mixtral). Everything in this package finds experts through
``moe_blocks``, so one walk decides what counts as an MoE layer.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


def moe_blocks(model) -> list[tuple[int, nn.Module]]:
    """(layer index, sparse block) for every layer whose child module holds a ``switch_mlp``."""
    found = []
    for i, layer in enumerate(model.layers):
        for child in layer.children().values():
            if isinstance(child, nn.Module) and "switch_mlp" in child:
                found.append((i, child))
                break
    return found


def module_path(model, module: nn.Module) -> str:
    """The dotted name mlx-lm gives ``module`` inside ``model`` (its weight-file prefix)."""
    for name, m in model.named_modules():
        if m is module:
            return name
    raise ValueError("module is not part of the model")


def expert_params(switch: nn.Module) -> dict[str, mx.array]:
    """The per-expert tensors of a SwitchGLU: every parameter, each with the experts on axis 0.

    Plain models have ``{gate,up,down}_proj.weight`` (and ``.bias``); quantized ones add
    ``scales``/``biases``; all are stacked over experts, so one rule covers them all.
    """
    return dict(tree_flatten(switch.parameters()))


def top_k(block: nn.Module) -> int | None:
    """How many experts the block routes each token to (attribute names differ by model)."""
    for name in ("top_k", "num_experts_per_tok"):
        k = getattr(block, name, None)
        if isinstance(k, int):
            return k
    return None


def router(block: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """x (tokens, D) -> the top-k expert ids the block would pick, or None for unknown gates.

    olmoe/qwen2_moe take top-k of the softmax, mixtral of the raw logits; softmax is monotonic,
    so top-k of the logits picks the same experts for both and skips the exponentials.
    """
    k = top_k(block)
    if k is None or not isinstance(getattr(block, "gate", None), nn.Linear):
        return None

    def route(x: mx.array) -> mx.array:  # the block's gate as it is now (a metered run swaps it for a wrapper)
        return mx.argpartition(-block.gate(x), kth=k - 1, axis=-1)[..., :k]

    return route


def router_scores(block: nn.Module) -> Callable[[mx.array], mx.array] | None:
    """x (tokens, D) -> the router's probability of each expert (softmax of its logits; its top-k are the experts
    ``router`` picks), or None for unknown gates. What a predictor's confidence in an expert is read from."""
    if top_k(block) is None or not isinstance(getattr(block, "gate", None), nn.Linear):
        return None
    return lambda x: mx.softmax(block.gate(x).astype(mx.float32), axis=-1)


def top_scored(probs, k: int):
    """The ``k`` most probable experts of one token's router probabilities (numpy, (E,)), most probable first, and
    the probabilities themselves: what a predictor passes to ``cache.prefetch`` (experts, scores)."""
    order = probs.argsort()[::-1][:k]
    return [int(e) for e in order], probs
