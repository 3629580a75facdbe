"""Putting an ExpertCache under a model: each SwitchGLU computes on slots instead of all experts."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from ..errors import M2R2Error
from .blocks import expert_params, module_path, moe_blocks, router, router_scores
from .cache import ExpertCache
from .store import ExpertStore, mlx_dtype


class CachedSwitchGLU(nn.Module):
    """A SwitchGLU whose expert tensors are the cache's slot tensors.

    ``inner`` is the model's own SwitchGLU (SwitchLinear or QuantizedSwitchLinear projections)
    with each per-expert parameter replaced by an (S, ...) slot tensor; the math is mlx-lm's,
    only the expert ids change (to slot ids).
    """

    def __init__(self, inner: nn.Module, cache: ExpertCache, layer: int):
        super().__init__()
        self.inner = inner
        self.cache = cache
        self.layer = layer

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        cache, layer, mode = self.cache, self.layer, self.cache.mode
        if mode.resident_only:  # a predictor running ahead, routed to resident experts: no loads, no sync
            return self.inner(x, cache.slot_map(layer)[indices])
        d = x.shape[-1]
        if mode.fused_rows:  # a fast stream riding along as the last batch rows: routed to the slow rows' experts
            slow = x.shape[0] - mode.fused_rows
            ids = np.array(indices[:slow])
            cache.host_sync()
            rounds = cache.begin_layer(layer, x[:slow].reshape(-1, d), ids.reshape(-1))
            cache.ensure(layer, rounds[0])  # decode steps only: one token's experts fit the slots
            return self.inner(x, cache.slot_map(layer)[indices])
        ids = np.array(indices)  # a sync point: which experts to load is known only once the router ran
        cache.host_sync()
        rounds = cache.begin_layer(layer, x.reshape(-1, d), ids.reshape(-1))
        if len(rounds) == 1:
            cache.ensure(layer, rounds[0])
            return self.inner(x, cache.slot_map(layer)[indices])
        return self._in_rounds(x.reshape(-1, d), ids, rounds).reshape(*indices.shape, d)

    def _in_rounds(self, x: mx.array, ids: np.ndarray, rounds: list[list[int]]) -> mx.array:
        """More distinct experts than slots (a long prompt at a small budget): S experts at a time.

        Each (token, expert) pair goes through the same matmul as in one call (only the number of
        rows per call changes, which on some CPUs' BLAS kernels moves the last bit of a logit),
        and each round is evaluated before the next one overwrites the slots.
        """
        cache, layer = self.cache, self.layer
        pair_expert = ids.reshape(-1)
        pair_token = np.repeat(np.arange(ids.size // ids.shape[-1]), ids.shape[-1])
        order, outputs = [], []
        for group in rounds:
            cache.ensure(layer, group)
            sel = np.flatnonzero(np.isin(pair_expert, group))
            slot_ids = cache.slot_map(layer)[mx.array(pair_expert[sel])][:, None]
            y = self.inner(x[mx.array(pair_token[sel])], slot_ids)[:, 0]
            mx.eval(y)
            order.append(sel)
            outputs.append(y)
        inverse = np.argsort(np.concatenate(order))
        return mx.concatenate(outputs)[mx.array(inverse)]


def _check_matches(store: ExpertStore, layer: int, prefix: str, params: dict[str, mx.array]) -> None:
    """The store must hold this model's experts: same layers, weight names, shapes and dtypes.

    (Weights of another checkpoint of the same architecture pass; telling them apart would
    mean reading the model's experts, which an offloaded model is meant never to do.)
    """
    have = {f"{prefix}.{name}": (list(a.shape[1:]), a.dtype) for name, a in params.items()}
    want = {f"{store.prefix(layer)}.{p['name']}": (p["shape"], mlx_dtype(p["dtype"])) for p in store.params(layer)}
    num = next(iter(params.values())).shape[0]
    if have != want or num != store.num_experts(layer):
        raise M2R2Error(
            f"the expert store in {store.folder} does not match this model at layer {layer} "
            f"({store.num_experts(layer)} experts {want} vs {num} experts {have}); export it from this model"
        )


def offload_experts(model, store: ExpertStore | str | Path, budget: float | int | str = 1.0, **cache) -> ExpertCache:
    """Serve every MoE layer's experts from ``store`` through an ExpertCache within ``budget``; ``cache``: the
    ExpertCache's keyword arguments (policy, clock, planner, io, device_scale, tracer: cache.py).

    The model's own expert tensors are dropped (their memory is freed once nothing else holds
    them); the routers stay in place and are also reachable as ``cache.routers[layer]``.
    """
    if not isinstance(store, ExpertStore):
        store = ExpertStore.open(store)
    blocks = moe_blocks(model)
    if any(isinstance(block.switch_mlp, CachedSwitchGLU) for _, block in blocks):
        raise M2R2Error("this model's experts are already offloaded to an expert cache")
    if [i for i, _ in blocks] != store.layers:
        raise M2R2Error(
            f"the expert store in {store.folder} has MoE layers {store.layers}, this model "
            f"{[i for i, _ in blocks]}; export it from this model"
        )
    for i, block in blocks:
        _check_matches(store, i, module_path(model, block.switch_mlp), expert_params(block.switch_mlp))
    cache = ExpertCache(store, budget, **cache)
    for i, block in blocks:
        inner = block.switch_mlp
        inner.update(tree_unflatten(list(cache.slots[i].items())))  # the slot tensors themselves, shared
        block.switch_mlp = CachedSwitchGLU(inner, cache, i)
        route, scores = router(block), router_scores(block)
        if route is not None:
            cache.routers[i], cache.scorers[i] = route, scores
    mx.clear_cache()
    return cache
